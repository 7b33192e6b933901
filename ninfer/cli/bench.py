"""`ninfer-bench`: prefill (pp) and decode (tg) throughput of a model or of a synthetic model of a geometry.

Each repetition is one request: a random prompt of -p tokens, then -n generated tokens (greedy unless
--sampling names a preset, eos ignored).
pp = prompt tokens / prefill time; tg = (n - 1) / time from the first to the last generated token, i.e.
decode at context p..p+n. One untimed warm-up request runs first.
`--suite issue5` measures issue 5's whole table in one process instead (`ninfer.cli.bench_suite`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path

import torch

from ninfer.cli.bench_suite import SUITES
from ninfer.cli.common import make_parser, run_cli
from ninfer.engine.api import GenerationRequest, SamplingParams, TokenEvent
from ninfer.engine.engine import DTYPES, Engine, EngineConfig
from ninfer.engine.synthetic import GEOMETRIES, WTYPES
from ninfer.errors import EngineConfigError
from ninfer.frontend.presets import NON_THINKING_PRESET, THINKING_PRESET
from ninfer.kernels.kv_quant import KV_DTYPES

SAMPLING = {"greedy": {"temperature": 0.0}, "thinking": THINKING_PRESET, "non-thinking": NON_THINKING_PRESET}


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("ninfer-bench", "Measure prefill and decode throughput (tokens/s).")
    p.add_argument("model", nargs="?", help="path of the .ninfer artifact (or use --synthetic)")
    p.add_argument("--synthetic", choices=sorted(GEOMETRIES), help="random model of this geometry, built in "
                                                                   "memory (on CPU only tiny is practical)")
    p.add_argument("--wtype", default="bf16", choices=WTYPES,
                   help="weights of the synthetic model: bf16 (dense) or a GGUF type whose random blocks "
                        "stay on the device with --quantized-weights (default on CUDA); token embedding q4_k "
                        "and output head q6_k like ../shared/tools/synth_qwen35_gguf.py (default bf16)")
    p.add_argument("--quantized-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="keep GGUF weights as blocks on the device (quantized kernels) instead of "
                        "dequantising them to --dtype (default: on CUDA yes, on CPU no)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="decode rounds through captured CUDA graphs (default: the engine's default)")
    p.add_argument("--decode-lookahead", action=argparse.BooleanOptionalAction, default=None,
                   help="decode rounds launch the next round before their tokens reach the host "
                        "(EngineConfig.decode_lookahead; default: on CUDA yes, on CPU no)")
    p.add_argument("--suite", choices=SUITES,
                   help="issue5: copy bandwidth, memory, pp512 + tg128, 4-/1-column step, C=1/2/4/8 "
                        "aggregate decode, pp8192, tg128 at 16K depth, each beside its target "
                        "(-n sets the generated tokens; -r the pp512/tg128 repetitions; see "
                        "docs/cli-run-bench.md)")
    p.add_argument("--suite-scale", type=float, default=1.0,
                   help="multiply the suite's prompt sizes (512, 8192, 16384) and copy size by this (0, 1] "
                        "(tests, CPU; default 1)")
    p.add_argument("--concurrency", default="1,2,4,8",
                   help="the suite's concurrency levels (default 1,2,4,8)")
    p.add_argument("--json", type=Path, metavar="PATH", dest="json_path",
                   help="also write the results as JSON to PATH (the suite rewrites it after every row)")
    p.add_argument("--sampling", choices=tuple(SAMPLING), default="greedy",
                   help="the generated tokens' sampling: greedy (default) or a Qwen preset as ninfer-serve "
                        "applies it: thinking (T 1.0, top-p 0.95, top-k 20), non-thinking (T 0.7, top-p 0.8, "
                        "top-k 20, presence penalty 1.5); seeded")
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens (default 128)")
    p.add_argument("-r", "--repetitions", type=int, default=3, help="timed repetitions (default 3)")
    p.add_argument("--kv-dtype", default="bf16", help="KV cache dtype, or a comma-separated list to compare "
                                                      f"({', '.join(KV_DTYPES)}; default bf16)")
    p.add_argument("--gdn-state-fp16", action="store_true",
                   help="keep Gated DeltaNet states in fp16 (default fp32)")
    p.add_argument("--perplexity", type=Path, metavar="TEXT_FILE",
                   help="instead of pp/tg: perplexity of the file's first --ppl-tokens tokens per KV dtype")
    p.add_argument("--ppl-tokens", type=int, default=3072,
                   help="tokens scored by --perplexity (default 3072)")
    p.add_argument("--vs-transformers", type=Path, metavar="GGUF",
                   help="also time transformers (fp32, its GGUF loader) decoding the same prompt from "
                        "this GGUF")
    p.add_argument("--prefill-chunk", type=int,
                   help="prefill chunk (default: the whole prompt; the suite: 2048)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                   help="compute dtype (default float32)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table", help="output format")
    return p


def make_engine(args, kv_dtype: str, ctx: int, chunk: int, lanes: int = 1,
                kv_tokens: int | None = None) -> tuple[Engine, str]:
    config = EngineConfig(max_concurrency=lanes, max_context=ctx, kv_capacity=kv_tokens or ctx,
                          kv_dtype=kv_dtype, gdn_state_fp16=args.gdn_state_fp16, device=args.device,
                          dtype=args.dtype, prefill_chunk=chunk, quantized_weights=args.quantized_weights,
                          decode_lookahead=args.decode_lookahead)
    if args.cuda_graphs is not None:
        if "cuda_graphs" not in {f.name for f in fields(EngineConfig)}:
            raise EngineConfigError("--cuda-graphs / --no-cuda-graphs: this engine has no CUDA-graph decode")
        config = replace(config, cuda_graphs=args.cuda_graphs)
    if args.synthetic:
        from ninfer.engine.synthetic import synthetic_model

        config.validate()
        model = synthetic_model(args.synthetic, DTYPES[args.dtype], args.device, wtype=args.wtype,
                                quantized_weights=config.keeps_quantized_weights)
        return Engine.from_model(model, config), f"synthetic-{args.synthetic} ({args.wtype})"
    return Engine(args.model, config), Path(args.model).stem


def bench_prompt(vocab: int, n: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, min(vocab, 4000), (n,), generator=g).tolist())


def run_once(engine: Engine, ids: tuple[int, ...], n_gen: int, sampling: str = "greedy"
             ) -> tuple[TokenEvent, list[int]]:
    params = SamplingParams(max_tokens=n_gen, ignore_eos=True, seed=len(ids), **SAMPLING[sampling])
    handle = engine.submit(GenerationRequest("bench", ids, params))
    tokens: list[int] = []
    while True:  # drive the rounds on this thread: no loop-thread wake-up latency in the numbers
        rnd = engine.scheduler.schedule()
        if rnd is not None:
            engine.step(rnd)
        while (ev := handle.next_event(0)) is not None:
            tokens += ev.token_ids
            if ev.finish_reason is not None:
                if ev.finish_reason == "error":
                    raise EngineConfigError(f"benchmark request failed: {ev.error}")
                return ev, tokens


def transformers_decode(gguf: Path, ids: tuple[int, ...], n_gen: int) -> tuple[float, list[int]]:
    """transformers (fp32) on the same GGUF: decode tok/s over the same greedy steps, and its tokens."""
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    hf.eval()
    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n_gen, min_new_tokens=n_gen, do_sample=False,
                          logits_processor=LogitsProcessorList([Stamp()]))
    return (n_gen - 1) / (stamps[-1] - stamps[0]), out[0, len(ids):].tolist()


def summarise(samples: list[float]) -> tuple[float, float]:
    return statistics.fmean(samples), statistics.stdev(samples) if len(samples) > 1 else 0.0


def parse_kv_dtypes(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in KV_DTYPES]
    if bad or not names:
        raise EngineConfigError(f"unknown --kv-dtype {', '.join(bad) or text!r}; choose from "
                                f"{', '.join(KV_DTYPES)}")
    return names


def body(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if (args.model is None) == (args.synthetic is None):
        raise EngineConfigError("give either MODEL or --synthetic NAME")
    if args.n_prompt < 1 or args.n_gen < 2 or args.repetitions < 1:
        raise EngineConfigError("-p must be >= 1, -n >= 2 and -r >= 1")
    if args.perplexity is not None and args.synthetic:
        raise EngineConfigError("--perplexity needs a MODEL artifact (its tokenizer), not --synthetic")
    kv_dtypes = parse_kv_dtypes(args.kv_dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.suite is not None:
        return suite_body(args, kv_dtypes)
    if args.perplexity is not None:
        ctx, chunk = args.ppl_tokens, args.prefill_chunk or 512
    else:
        ctx, chunk = args.n_prompt + args.n_gen, args.prefill_chunk or args.n_prompt
    t0 = time.monotonic()
    engine, name = make_engine(args, kv_dtypes[0], ctx, chunk)
    elapsed = time.monotonic() - t0
    print(f"loaded {name} in {elapsed:.1f} s · {engine.memory_ledger().line()}", file=sys.stderr)
    common = dict(model=name, device=args.device, dtype=args.dtype, threads=torch.get_num_threads())
    rows = []
    ppl_ids = None
    if args.perplexity is not None:
        ppl_ids = engine.tokenizer.encode(args.perplexity.read_text(encoding="utf-8"))[: args.ppl_tokens]
    for kv in kv_dtypes:
        if kv != engine.config.kv_dtype:
            config = replace(engine.config, kv_dtype=kv)
            engine = Engine.from_model(engine.model, config, tuple(engine.eos_ids))
        if args.perplexity is not None:
            rows.append({**common, "kv_dtype": kv, **perplexity_row(engine, ppl_ids)})
        else:
            rows += speed_rows(engine, args, {**common, "kv_dtype": kv})
    if args.vs_transformers is not None and args.perplexity is None:
        ids = bench_prompt(getattr(engine.model, "vocab_size", 1000), args.n_prompt, seed=0)
        ours = run_once(engine, ids, args.n_gen)[1]
        tps, theirs = transformers_decode(args.vs_transformers, ids, args.n_gen)
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), len(ours))
        rows.append({**common, "model": "transformers (fp32)", "dtype": "float32", "kv_dtype": "-",
                     "test": f"tg{args.n_gen}", "tok_per_s": tps, "std": 0.0, "samples": [tps],
                     "greedy_tokens_equal_to_ninfer": same})
    print(json.dumps(rows, indent=1) if args.output == "json" else table(rows))
    if args.json_path is not None:
        args.json_path.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


def suite_body(args, kv_dtypes: list[str]) -> int:
    """`--suite`: one engine sized for the deepest and the widest phase, the rows as they are measured."""
    from ninfer.cli.bench_suite import SuiteReport, SuiteRun, SuiteSizes, run_suite, stream_for, suite_header
    from ninfer.engine.memory import stored_weight_bytes

    if len(kv_dtypes) > 1 or args.perplexity is not None or args.vs_transformers is not None:
        raise EngineConfigError("--suite takes one --kv-dtype and no --perplexity / --vs-transformers")
    sizes = SuiteSizes.scaled(args.suite_scale, args.n_gen, parse_concurrency(args.concurrency),
                              args.repetitions)
    t0 = time.monotonic()
    engine, name = make_engine(args, kv_dtypes[0], sizes.context_tokens(), args.prefill_chunk or 2048,
                               lanes=max(sizes.concurrency), kv_tokens=sizes.kv_tokens())
    elapsed = time.monotonic() - t0
    print(f"loaded {name} in {elapsed:.1f} s · {engine.memory_ledger().line()}", file=sys.stderr, flush=True)
    if args.synthetic:
        from ninfer.engine.synthetic import synthetic_source

        stored = synthetic_source(args.synthetic, wtype=args.wtype, device="meta").stored_bytes()
    else:
        stored = stored_weight_bytes(engine.artifact)
    wtype = args.wtype if args.synthetic else artifact_wtype(engine.artifact)
    header = suite_header(args, name, wtype, sizes, engine, stored)
    report = SuiteReport(header, stream_for(args.output), args.json_path)
    full_gpu = args.suite_scale == 1 and args.device.startswith("cuda")
    run = SuiteRun(engine, sizes, report, args.device, wtype,
                   judge_absolute=full_gpu and is_27b(engine.model), judge_ratios=full_gpu)
    run_suite(run, stored)
    if args.output == "json":
        print(json.dumps(report.as_dict(), indent=1))
    return 0


def artifact_wtype(artifact) -> str:
    """The GGUF type of the first MLP projection (`iq3_s`, `q4_k`...): the weight type the targets name."""
    try:
        return artifact.tensor("text/layers/0/mlp/gate").format.removeprefix("gguf_")
    except Exception:  # not a Qwen-layout artifact: no per-type target
        return ""


def is_27b(model) -> bool:
    """The 27B text geometry (issue 5's tok/s targets are for it)."""
    cfg = getattr(model, "cfg", None)
    return getattr(cfg, "hidden_size", 0) == 5120 and len(getattr(model, "layers", ())) == 64


def parse_concurrency(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise EngineConfigError(f"--concurrency must be comma-separated integers, got {text!r}") from None


def speed_rows(engine: Engine, args, common: dict) -> list[dict]:
    vocab = getattr(engine.model, "vocab_size", 1000)
    run_once(engine, bench_prompt(vocab, min(args.n_prompt, 16), seed=-1), 2, args.sampling)  # warm-up
    pp, tg = [], []
    for r in range(args.repetitions):
        ev, _ = run_once(engine, bench_prompt(vocab, args.n_prompt, seed=r), args.n_gen, args.sampling)
        pp.append(ev.prefill_tok_per_s)
        tg.append(ev.decode_tok_per_s)
    rows = []
    for test, samples in ((f"pp{args.n_prompt}", pp), (f"tg{args.n_gen}", tg)):
        mean, std = summarise(samples)
        rows.append({**common, "test": test, "tok_per_s": mean, "std": std, "samples": samples,
                     "sampling": args.sampling})
    return rows


def perplexity_row(engine: Engine, ids: list[int]) -> dict:
    from ninfer.engine.perplexity import perplexity

    t0 = time.monotonic()
    ppl, scored = perplexity(engine, ids, chunk=engine.config.prefill_chunk)
    return {"test": f"ppl{scored + 1}", "perplexity": ppl, "seconds": time.monotonic() - t0}


def table(rows: list[dict]) -> str:
    head = f"| {'model':<32} | {'kv':<6} | {'device':<6} | {'dtype':<8} | {'test':<8} | {'result':>20} |"
    lines = [head, "|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|"]
    for r in rows:
        if "perplexity" in r:
            result = f"ppl {r['perplexity']:.4f}"
        else:
            result = f"{r['tok_per_s']:.2f} ± {r['std']:.2f} tok/s"
        lines.append(f"| {r['model'][:32]:<32} | {r['kv_dtype']:<6} | {r['device']:<6} | {r['dtype']:<8} | "
                     f"{r['test']:<8} | {result:>20} |")
        if "greedy_tokens_equal_to_ninfer" in r:
            lines.append(f"(transformers greedy tokens equal to ninfer's for the first "
                         f"{r['greedy_tokens_equal_to_ninfer']} of {args_n(r)})")
    return "\n".join(lines)


def args_n(row: dict) -> str:
    return row["test"].removeprefix("tg")


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(body, argv)


if __name__ == "__main__":
    sys.exit(main())
