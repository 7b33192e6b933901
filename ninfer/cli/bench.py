"""`ninfer-bench`: prefill (pp) and decode (tg) throughput of a model or of a synthetic model of a geometry.

Each repetition is one request: a random prompt of -p tokens, then -n generated tokens (greedy, eos ignored).
pp = prompt tokens / prefill time; tg = (n - 1) / time from the first to the last generated token, i.e.
decode at context p..p+n. One untimed warm-up request runs first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ninfer.cli.common import make_parser, run_cli
from ninfer.engine.api import GenerationRequest, SamplingParams, TokenEvent
from ninfer.engine.engine import DTYPES, Engine, EngineConfig
from ninfer.engine.synthetic import GEOMETRIES
from ninfer.errors import EngineConfigError
from ninfer.kernels.kv_quant import KV_DTYPES


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("ninfer-bench", "Measure prefill and decode throughput (tokens/s).")
    p.add_argument("model", nargs="?", help="path of the .ninfer artifact (or use --synthetic)")
    p.add_argument("--synthetic", choices=sorted(GEOMETRIES), help="random model of this geometry, built in "
                                                                   "memory (on CPU only tiny is practical)")
    p.add_argument("--wtype", default="bf16", help="weight type label of the synthetic model, e.g. iq3_s (on "
                                                   "CPU weights are dense in --dtype whatever this says)")
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens (default 128)")
    p.add_argument("-r", "--repetitions", type=int, default=3, help="timed repetitions (default 3)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16", help="KV cache dtype (default bf16)")
    p.add_argument("--prefill-chunk", type=int, help="prefill chunk (default: the whole prompt)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                   help="compute dtype (default float32)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table", help="output format")
    return p


def make_engine(args) -> tuple[Engine, str]:
    ctx = args.n_prompt + args.n_gen
    config = EngineConfig(max_context=ctx, kv_capacity=ctx, kv_dtype=args.kv_dtype, device=args.device,
                          dtype=args.dtype, prefill_chunk=args.prefill_chunk or args.n_prompt)
    if args.synthetic:
        from ninfer.engine.synthetic import synthetic_model

        model = synthetic_model(args.synthetic, DTYPES[args.dtype], args.device)
        return Engine.from_model(model, config), f"synthetic-{args.synthetic} ({args.wtype})"
    return Engine(args.model, config), Path(args.model).stem


def run_once(engine: Engine, args, seed: int) -> TokenEvent:
    vocab = getattr(engine.model, "vocab_size", 1000)
    g = torch.Generator().manual_seed(seed)
    ids = tuple(torch.randint(0, min(vocab, 4000), (args.n_prompt,), generator=g).tolist())
    params = SamplingParams(max_tokens=args.n_gen, temperature=0.0, ignore_eos=True)
    handle = engine.submit(GenerationRequest(f"bench-{seed}", ids, params))
    while True:  # drive the rounds on this thread: no loop-thread wake-up latency in the numbers
        rnd = engine.scheduler.schedule()
        if rnd is not None:
            engine.step(rnd)
        while (ev := handle.next_event(0)) is not None:
            if ev.finish_reason is not None:
                if ev.finish_reason == "error":
                    raise EngineConfigError(f"benchmark request failed: {ev.error}")
                return ev


def summarise(samples: list[float]) -> tuple[float, float]:
    return statistics.fmean(samples), statistics.stdev(samples) if len(samples) > 1 else 0.0


def body(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if (args.model is None) == (args.synthetic is None):
        raise EngineConfigError("give either MODEL or --synthetic NAME")
    if args.n_prompt < 1 or args.n_gen < 2 or args.repetitions < 1:
        raise EngineConfigError("-p must be >= 1, -n >= 2 and -r >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    engine, name = make_engine(args)
    elapsed = time.monotonic() - t0
    print(f"loaded {name} in {elapsed:.1f} s · {engine.memory_ledger().line()}", file=sys.stderr)
    run_once(engine, argparse.Namespace(n_prompt=min(args.n_prompt, 16), n_gen=2), seed=-1)  # warm-up
    pp, tg = [], []
    for r in range(args.repetitions):
        ev = run_once(engine, args, seed=r)
        pp.append(ev.prefill_tok_per_s)
        tg.append(ev.decode_tok_per_s)
    common = dict(model=name, kv_dtype=args.kv_dtype, device=args.device, dtype=args.dtype,
                  threads=torch.get_num_threads())
    rows = []
    for test, samples in ((f"pp{args.n_prompt}", pp), (f"tg{args.n_gen}", tg)):
        mean, std = summarise(samples)
        rows.append({**common, "test": test, "tok_per_s": mean, "std": std, "samples": samples})
    print(json.dumps(rows, indent=1) if args.output == "json" else table(rows))
    return 0


def table(rows: list[dict]) -> str:
    head = f"| {'model':<32} | {'kv':<6} | {'device':<6} | {'dtype':<8} | {'test':<8} | {'tok/s':>18} |"
    lines = [head, "|" + "|".join("-" * (len(c) + 0) for c in head.split("|")[1:-1]) + "|"]
    for r in rows:
        tps = f"{r['tok_per_s']:.2f} ± {r['std']:.2f}"
        lines.append(f"| {r['model']:<32} | {r['kv_dtype']:<6} | {r['device']:<6} | {r['dtype']:<8} | "
                     f"{r['test']:<8} | {tps:>18} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(body, argv)


if __name__ == "__main__":
    sys.exit(main())
