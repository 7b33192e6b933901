"""tg128 of one synthetic model under engines of several shapes (lanes, max context), in one process: what an
engine sized for a server (the suite's: 8 lanes, ~16.6K tokens) costs a lone short chat against the
plain bench's engine (1 lane, prompt + generated tokens). Session 68's lead: the plain bench's Q4_K tg128
198.2-198.5 against the suite's 195.9 on the H200.

    python3 bench/tg_engine.py --wtype q4_k --shapes 1:640,8:640,1:16576,8:16576,8:16576:8,8:16576:w [-r 3]

A shape's optional third field caps the decode attention's splits (`paged_attention.DECODE_SPLITS`, 64) for
that engine's graphs: a 16K engine's lone 512-token chat launches 64 splits a KV head, 5 of them with pages;
`w` instead gives the engine graphs of page tables 16 and 64 pages wide beside its own
(`graphs.GRAPH_WIDTHS`; NINFER_GRAPH_WIDTHS=16,64), the chat's rounds replaying the 16-page ones; `o` the
engine as it was before session 72's defaults (graphs of its own width only, the GDN state written in the
recurrence: NINFER_GRAPH_WIDTHS= NINFER_GDN_STATE_SIDE=0).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.cli.bench import bench_prompt, run_once, summarise  # noqa: E402
from ninfer.engine.engine import Engine, EngineConfig  # noqa: E402
from ninfer.engine.synthetic import synthetic_model  # noqa: E402
from ninfer.kernels import paged_attention  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wtype", default="q4_k")
    p.add_argument("--synthetic", default="27b")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--shapes", default="1:640,8:640,1:16576,8:16576",
                   help="LANES:MAX_CONTEXT[:SPLITS|w|o], comma-separated")
    p.add_argument("-p", "--n-prompt", type=int, default=512)
    p.add_argument("-n", "--n-gen", type=int, default=128)
    p.add_argument("-r", "--repetitions", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="passes over the shapes, alternating order")
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    on_gpu = a.device.startswith("cuda")
    model = synthetic_model(a.synthetic, getattr(torch, a.dtype), a.device, wtype=a.wtype,
                            quantized_weights=on_gpu)
    vocab = model.vocab_size
    shapes = [tuple(s.split(":")) for s in a.shapes.split(",")]
    results: dict[tuple[str, ...], list[float]] = {s: [] for s in shapes}
    default_splits = paged_attention.DECODE_SPLITS
    widths, side = os.environ.get("NINFER_GRAPH_WIDTHS"), os.environ.get("NINFER_GDN_STATE_SIDE")
    for r in range(a.rounds):
        for shape in shapes if r % 2 == 0 else shapes[::-1]:
            lanes, ctx, *extra = shape
            lanes, ctx = int(lanes), int(ctx)
            split = extra and extra[0].isdigit()
            paged_attention.DECODE_SPLITS = int(extra[0]) if split else default_splits  # read at capture
            old = extra == ["o"]
            set_env("NINFER_GRAPH_WIDTHS", "" if old else "16,64" if extra and not split else widths)
            set_env("NINFER_GDN_STATE_SIDE", "0" if old else side)
            # KV for the context, or for every lane's chat at once (as the suite sizes its engine)
            kv = max(ctx, lanes * (a.n_prompt + a.n_gen + 64))
            config = EngineConfig(max_concurrency=lanes, max_context=ctx, kv_capacity=kv, device=a.device,
                                  dtype=a.dtype, prefill_chunk=a.n_prompt, quantized_weights=on_gpu)
            engine = Engine.from_model(model, config)
            run_once(engine, bench_prompt(vocab, 16, seed=-1), 2)  # warm-up
            for rep in range(a.repetitions):
                ev, _ = run_once(engine, bench_prompt(vocab, a.n_prompt, seed=rep), a.n_gen)
                results[shape].append(ev.decode_tok_per_s)
            mean, _ = summarise(results[shape][-a.repetitions:])
            print(f"  pass {r}: {label(shape)}: tg{a.n_gen} {mean:.2f} tok/s", flush=True)
            del engine
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()
    runs = f"{a.rounds}×{a.repetitions}"
    print(f"\n| engine ({a.wtype}, {a.dtype}) | tg{a.n_gen} tok/s (mean ± std of {runs}) |")
    print("|---|---|")
    for shape, samples in results.items():
        mean, std = summarise(samples)
        print(f"| {label(shape)} | {mean:.2f} ± {std:.2f} |")
    paged_attention.DECODE_SPLITS = default_splits
    set_env("NINFER_GRAPH_WIDTHS", widths)
    set_env("NINFER_GDN_STATE_SIDE", side)
    return 0


def set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def label(shape: tuple[str, ...]) -> str:
    lanes, ctx, *extra = shape
    more = ""
    if extra == ["o"]:
        more = ", session 71's graphs (own width, state in the recurrence)"
    elif extra:
        more = f", at most {extra[0]} splits" if extra[0].isdigit() else ", graphs of 16 / 64 / all pages"
    return f"{lanes} lanes, context {int(ctx):,}" + more


if __name__ == "__main__":
    raise SystemExit(main())
