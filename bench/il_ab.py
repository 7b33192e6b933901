"""The il32 GEMVs of this tree against another version of `ninfer/kernels/gemv_il.py` (a file: e.g.
`git show REV:ninfer/kernels/gemv_il.py > /tmp/prev.py`) on the 27B's iq3_s matrices, each routed as its own
version routes it and on its own repack of the same GGUF copies (the layout may differ): both checked against
the float64 product of the dequantised weight, then timed as `bench/gpu_check.py`'s `graph_us` does (one CUDA
graph over weight copies larger than 3× L2) in the order A B B A, with this tree's kernels also timed without
their tile ring (`_RING`, `_MMA_RING` = 1).

    python3 bench/il_ab.py /tmp/prev.py [--shapes 34816x5120,...] [--widths 1,2,4,8]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_check import graph_us, rel_err  # noqa: E402
from bench.il_group256 import il32_activation, iq3s_copies  # noqa: E402
from ninfer.kernels import gemv_il as now  # noqa: E402
from ninfer.kernels.gemv_q8 import QuantizedActivation  # noqa: E402


def load(path: Path, name: str = "gemv_il_other"):
    """The other version as a module of its own (its own compile caches)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


def timed(module, s, copies: list[torch.Tensor], xa: QuantizedActivation, n: int, ring: int | None = None
          ) -> float:
    """µs a call of `module.gemv_il` on schedule s over the weight copies; `ring`: this tree's tile rings
    capped at it meanwhile."""
    saved = now._RING, now._MMA_RING
    if ring is not None:
        now._RING = now._MMA_RING = ring
    try:
        return graph_us([lambda w=w: module.gemv_il(w, xa, n, s) for w in copies])
    finally:
        now._RING, now._MMA_RING = saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("other", type=Path, help="the other gemv_il.py")
    p.add_argument("--shapes", default="34816x5120,16480x5120,5120x17408,14336x5120,5120x6144")
    p.add_argument("--widths", default="1,2,4,8")
    args = p.parse_args()
    other = load(args.other)
    torch.manual_seed(0)
    group, rows, worst = now.il_group(), [], 0.0
    for shape in args.shapes.split(","):
        n, k, raws, dense = iq3s_copies(shape)
        # each version's own repack (the layout may differ between them)
        copies = {m: [m.repack_il32(raw) for raw in raws] for m in (other, now)}
        del raws
        for width in (int(w) for w in args.widths.split(",")):
            xa, fp32, want = il32_activation(width, dense, group)
            s_other, s_now = other.il_schedule(width, k, n, group), now.il_schedule(width, k, n, group)
            errors = [rel_err(m.gemv_il(copies[m][0], fp32, n, s), want)
                      for m, s in ((other, s_other), (now, s_now))]
            worst = max(worst, *errors)
            a, b = (copies[other], xa, n), (copies[now], xa, n)
            a1, b1, r1 = timed(other, s_other, *a), timed(now, s_now, *b), timed(now, s_now, *b, 1)
            r2, b2, a2 = timed(now, s_now, *b, 1), timed(now, s_now, *b), timed(other, s_other, *a)
            rows.append((shape, width, (a1 + a2) / 2, (b1 + b2) / 2, (r1 + r2) / 2))
            print(f"{shape} w{width}: other {a1:.1f} / {a2:.1f}, now {b1:.1f} / {b2:.1f}, now without its "
                  f"ring {r1:.1f} / {r2:.1f} µs (errors {errors[0]:.1e} / {errors[1]:.1e})", flush=True)
        del copies, dense
        torch.cuda.empty_cache()
    print("\n| matrix | columns | other (µs) | now (µs) | now, no ring | change |\n|---|---|---|---|---|---|")
    for shape, width, a, b, r in rows:
        print(f"| {shape} | {width} | {a:.1f} | {b:.1f} | {r:.1f} | {100 * (b / a - 1):+.1f} % |")
    if worst > 1e-4:
        raise SystemExit("a version is off the float64 product by more than 1e-4")


if __name__ == "__main__":
    main()
