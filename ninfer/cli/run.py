"""`ninfer MODEL (--prompt T | --messages FILE)`: the answer on stdout, reasoning and stats on stderr."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ninfer.cli.common import make_parser, run_cli
from ninfer.engine.api import GenerationRequest
from ninfer.engine.engine import Engine, EngineConfig
from ninfer.errors import NinferError, RequestError
from ninfer.kernels.kv_quant import KV_DTYPES


class RunError(NinferError):
    """A bad --messages file or prompt."""


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("ninfer", "Run one request on a .ninfer model: the answer on stdout, reasoning and "
                              "statistics on stderr.")
    p.add_argument("model", help="path of the .ninfer artifact")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="user message (chat-templated unless --raw)")
    src.add_argument("--messages", type=Path, help="JSON file: a list of chat messages, or "
                                                   '{"messages": [...], "tools": [...]}')
    g = p.add_argument_group("prompt")
    g.add_argument("--raw", action="store_true", help="tokenize --prompt as-is, no chat template")
    g.add_argument("--no-thinking", action="store_true",
                   help="render the template with enable_thinking=false")
    g.add_argument("--system", help="system message put before --prompt")
    g.add_argument("--chat-template", type=Path, help="jinja file replacing the artifact's chat template")
    s = p.add_argument_group("sampling (unset values come from the model's generation_config presets)")
    s.add_argument("--max-new", type=int, default=256, help="maximum generated tokens (default 256)")
    s.add_argument("--greedy", action="store_true", help="argmax decoding (temperature 0)")
    s.add_argument("--temperature", type=float)
    s.add_argument("--top-p", type=float)
    s.add_argument("--top-k", type=int, help="0 = off")
    s.add_argument("--min-p", type=float)
    s.add_argument("--presence-penalty", type=float)
    s.add_argument("--frequency-penalty", type=float)
    s.add_argument("--repetition-penalty", type=float)
    s.add_argument("--seed", type=int, help="sampling seed (same seed, same answer)")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    e = p.add_argument_group("engine")
    e.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16", help="KV cache dtype (default bf16)")
    e.add_argument("--max-context", type=int, help="context limit (default: prompt + --max-new)")
    e.add_argument("--prefill-chunk", type=int,
                   help="prefill chunk in tokens (default 1024 on a GPU, 512 on the CPU)")
    e.add_argument("--gdn-state-fp16", action="store_true", help="keep GDN recurrent state in fp16")
    e.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    e.add_argument("--dtype", default="float32", help="compute dtype: float32 or bfloat16 (default float32)")
    o = p.add_argument_group("output")
    o.add_argument("--print-token-ids", action="store_true",
                   help="also print the generated token ids on stderr")
    o.add_argument("--quiet", action="store_true", help="no reasoning and no statistics on stderr")
    return p


def load_messages(args) -> tuple[list, list | None]:
    if args.messages is None:
        msgs = [{"role": "system", "content": args.system}] if args.system else []
        return msgs + [{"role": "user", "content": args.prompt}], None
    try:
        data = json.loads(args.messages.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise RunError(f"--messages {args.messages}: not valid JSON ({exc.msg} at line {exc.lineno}); "
                       "fix the file") from None
    if isinstance(data, dict):
        return data.get("messages", []), data.get("tools")
    if not isinstance(data, list):
        raise RunError(f"--messages {args.messages}: expected a list of messages or an object with "
                       "'messages'")
    return data, None


def sampling_overrides(args) -> dict:
    values = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
              "presence_penalty": args.presence_penalty, "frequency_penalty": args.frequency_penalty,
              "repetition_penalty": args.repetition_penalty, "seed": args.seed}
    if args.greedy:
        values["temperature"] = 0.0
    values = {k: v for k, v in values.items() if v is not None}
    values.update(max_tokens=args.max_new, ignore_eos=args.ignore_eos)
    return values


def body(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_new < 1:
        raise RunError(f"--max-new must be >= 1, got {args.max_new}")
    from ninfer.frontend import TextFrontend

    if args.raw and args.prompt is None:
        raise RunError("--raw needs --prompt (a messages file is always chat-templated)")
    messages, tools = (None, None) if args.raw else load_messages(args)
    t0 = time.monotonic()
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    say(f"loading {args.model} ...")
    from ninfer.artifact import open_artifact

    # the frontend first: the context limit depends on the prompt's length

    frontend = TextFrontend.from_artifact(open_artifact(args.model), args.chat_template)
    if args.raw:
        prompt = frontend.raw_prompt(args.prompt)
    else:
        kwargs = {"enable_thinking": False} if args.no_thinking else {}
        prompt = frontend.chat_prompt(messages, tools=tools, **kwargs)
    params = frontend.sampling(prompt, **sampling_overrides(args))
    max_context = args.max_context or len(prompt.token_ids) + args.max_new
    config = EngineConfig(max_concurrency=1, max_context=max_context, kv_capacity=max_context,
                          kv_dtype=args.kv_dtype, gdn_state_fp16=args.gdn_state_fp16,
                          prefill_chunk=args.prefill_chunk, device=args.device, dtype=args.dtype)
    engine = Engine(args.model, config)
    say(f"loaded in {time.monotonic() - t0:.1f} s · {engine.memory_ledger().line()}")
    try:
        handle = engine.start().submit(GenerationRequest("cli", prompt.token_ids, params))
    except RequestError as exc:
        engine.shutdown()
        raise RunError(str(exc)) from None
    finish = print_stream(frontend.stream(handle, prompt, stop=args.stop, tools=tools), args.quiet)
    engine.shutdown()
    report(finish, args, say)
    return 0 if finish.reason != "error" else 1


def print_stream(stream, quiet: bool):
    """Content (and tool calls as JSON lines) to stdout as it streams; reasoning to stderr."""
    from ninfer.frontend import ContentDelta, Finish, ReasoningDelta, ToolCallDelta

    in_reasoning = False
    for delta in stream:
        if isinstance(delta, ReasoningDelta):
            if not quiet:
                print(delta.text, end="", file=sys.stderr, flush=True)
                in_reasoning = True
        elif isinstance(delta, ContentDelta):
            if in_reasoning:
                print(file=sys.stderr, flush=True)
                in_reasoning = False
            print(delta.text, end="", flush=True)
        elif isinstance(delta, ToolCallDelta):
            print(json.dumps(delta.call.to_openai(), ensure_ascii=False), flush=True)
        elif isinstance(delta, Finish):
            print(flush=True)
            if in_reasoning:
                print(file=sys.stderr, flush=True)
            return delta
    raise RunError("the engine ended the stream without a finish event")


def report(finish, args, say) -> None:
    u = finish.usage

    def f(x, unit):
        return "n/a" if x is None else f"{x:.3f} {unit}" if unit == "s" else f"{x:.1f} {unit}"

    say(f"finish {finish.reason} · prompt {u.prompt_tokens} tokens · generated {u.completion_tokens} · "
        f"TTFT {f(u.time_to_first_token_s, 's')} · prefill {f(u.prefill_tok_per_s, 'tok/s')} · "
        f"decode {f(u.decode_tok_per_s, 'tok/s')}")
    if finish.error:
        print(f"error: {finish.error}", file=sys.stderr)
    if args.print_token_ids:
        print("token ids: " + " ".join(str(t) for t in finish.token_ids), file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(body, argv)


if __name__ == "__main__":
    sys.exit(main())
