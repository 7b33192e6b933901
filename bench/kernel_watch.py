"""Find a kernel that writes where it should not (CUDA): the suite's engine on the synthetic 27B, every
function of `ninfer.kernels.*` (and the engine's KV pool, GDN mix and paged context) wrapped so that each
call synchronises before and after and checks that the KV page tables did not change under it (they only
change on admission and release, never inside a kernel call), then the suite's warm-up (a 16-token prompt,
two tokens) and one round of `--lanes` requests. The first call that changed them, or that left a CUDA
error, is named with its argument shapes. Captured CUDA graphs are not checked inside (no syncs there).

Session 31 found this way that a gated-norm variant wrote int8 codes over the page tables (a later
`kv_write` then faulted on a garbage page id); session 32 ran the fixed code through it clean (109,887 calls).

    python3 bench/kernel_watch.py [--lanes 8] [--wtype iq3_s]   # NINFER_IL_GROUP=32: the per-32 producers
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ninfer.kernels  # noqa: E402
from ninfer.cli.bench import build_parser, make_engine, parse_concurrency  # noqa: E402
from ninfer.cli.bench_suite import SuiteSizes, _submit, drive  # noqa: E402

WATCHED = ("ninfer.engine.kv_pool", "ninfer.engine.gdn_mix", "ninfer.engine.paged_context")


class Culprit(SystemExit):
    pass


def shapes(args, kwargs) -> str:
    def one(v):
        return tuple(v.shape) if isinstance(v, torch.Tensor) else v
    return f"{[one(a) for a in args][:10]} {({k: one(v) for k, v in kwargs.items()})}"


def watched(name: str, fn, state: dict):
    def call(*args, **kwargs):
        tables = state.get("tables")
        if tables is None or torch.cuda.is_current_stream_capturing():
            return fn(*args, **kwargs)
        try:
            torch.cuda.synchronize()
        except RuntimeError as e:  # from unwatched work since the last watched call
            raise Culprit(f"CUDA error before {name}: {e}") from e
        before = tables.clone()
        try:
            out = fn(*args, **kwargs)
            torch.cuda.synchronize()
        except RuntimeError as e:
            raise Culprit(f"error in {name}: {e}\n  arguments {shapes(args, kwargs)}") from e
        state["calls"] += 1
        if not torch.equal(before, tables):
            where = (before != tables).nonzero()[:4].tolist()
            raise Culprit(f"the page tables changed in {name} (call {state['calls']}) at {where}\n"
                          f"  arguments {shapes(args, kwargs)}")
        return out
    return call


def wrap_everything(state: dict) -> int:
    """Replace every plain function of the watched modules, wherever ninfer modules bound it."""
    names = [f"ninfer.kernels.{m.name}" for m in pkgutil.iter_modules(ninfer.kernels.__path__)]
    names += WATCHED
    originals = {}
    for module in map(importlib.import_module, names):
        for attr, fn in vars(module).items():
            if isinstance(fn, types.FunctionType) and fn.__module__ == module.__name__:
                originals[id(fn)] = watched(f"{module.__name__.rsplit('.', 1)[-1]}.{attr}", fn, state)
    for module in [m for name, m in list(sys.modules.items()) if name.startswith("ninfer") and m is not None]:
        for attr, fn in list(vars(module).items()):
            if isinstance(fn, types.FunctionType) and id(fn) in originals:
                setattr(module, attr, originals[id(fn)])
    return len(originals)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lanes", type=int, default=8)
    p.add_argument("--wtype", default="iq3_s")
    args = p.parse_args()
    state = {"calls": 0}
    print(f"watching {wrap_everything(state)} functions", flush=True)
    bench_args = build_parser().parse_args(["--synthetic", "27b", "--wtype", args.wtype, "--device", "cuda",
                                            "--dtype", "bfloat16"])
    sizes = SuiteSizes.scaled(1.0, 128, parse_concurrency("1,2,4,8"), 2)
    engine, _ = make_engine(bench_args, "bf16", sizes.context_tokens(), 2048, lanes=args.lanes,
                            kv_tokens=sizes.kv_tokens())
    state["tables"] = engine.kv.page_tables
    drive(engine, [_submit(engine, "warm", 16, 2, -1)], "cuda")
    print(f"warm-up: {state['calls']} calls checked", flush=True)
    drive(engine, [_submit(engine, "lane", 16, 4, seed) for seed in range(args.lanes)], "cuda")
    print(f"{args.lanes} lanes: {state['calls']} calls checked, no page table written", flush=True)


if __name__ == "__main__":
    main()
