"""Split-K rows GEMVs (one launch: the last split of each tile writes the output) beside the routes, on the
27B's merged decode matrices: checked against the float64 twin, then timed (µs a call in a CUDA graph over
weight copies larger than the L2). Prints, per matrix and width, the route's time and the best split-K
schedule's, and writes a `step_profile.py --sweep` setting that puts every faster split on its matrix.

    python3 bench/split_timing.py [--formats q4_k,iq3_s] [--widths 1,2] [--sweep-file PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_check import graph_us, weight_copies  # noqa: E402

from ninfer.kernels import gemv_rows, gemv_rows_iq  # noqa: E402
from ninfer.kernels.gemv_q8 import gemv_q8_reference, quantize_activation  # noqa: E402
from ninfer.kernels.gguf_matmul import random_gguf_weight  # noqa: E402

SHAPES = ((5120, 17408), (5120, 6144), (16480, 5120), (14336, 5120), (34816, 5120))
GAIN = 0.97  # a split schedule enters the sweep setting when it takes < 97 % of the route's time


def family(fmt: str):
    """(schedules, route, gemv) of a format's rows kernel."""
    if fmt == "iq3_s":
        return gemv_rows_iq.SCHEDULES, gemv_rows_iq.rows_iq_route, gemv_rows_iq.gemv_rows_iq
    return gemv_rows.SCHEDULES, gemv_rows.rows_route, gemv_rows.gemv_rows


def candidates(fmt: str, width: int) -> list[str]:
    schedules, _, _ = family(fmt)
    return [name for name, s in schedules.items()
            if s.split_k > 1 and s.block_m == width and "_sg" not in name and "_m1_" in name
            and (fmt == "iq3_s" or (s.rows_per_lane == 2 and s.lanes == "chunk"))]


def check(fmt: str, name: str, dev) -> float:
    """Worst relative error over two shapes (uneven splits, rows past the tile); the workspace must be left
    zero."""
    _, _, gemv = family(fmt)
    s = family(fmt)[0][name]
    worst = 0.0
    for rows, cols in ((1040, 6144), (200, 17408)):
        raw = random_gguf_weight(fmt, rows, cols, dev)
        xa = quantize_activation(torch.randn(s.block_m, cols, device=dev))
        y = gemv(raw, fmt, xa, rows, name)
        want = gemv_q8_reference(raw, fmt, xa, rows)
        want = want.cpu()
        worst = max(worst, float((y.double().cpu() - want).abs().max() / want.abs().max()))
    sums, counters = gemv_rows.split_workspace(dev, 0, 0)
    if sums.any() or counters.any():
        raise SystemExit(f"{fmt} {name}: the split-K workspace was not left zero")
    return worst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", default="q4_k,iq3_s")
    p.add_argument("--widths", default="1")
    p.add_argument("--sweep-file", default="")
    a = p.parse_args()
    dev = torch.device("cuda")
    setting = []
    rows_out = []
    for fmt in a.formats.split(","):
        for width in map(int, a.widths.split(",")):
            names = candidates(fmt, width)
            for name in names:
                err = check(fmt, name, dev)
                print(f"check {fmt} {name}: max error {err:.2e} of max|y|", flush=True)
                if err > 1e-5:
                    raise SystemExit(f"{fmt} {name}: error {err:.2e}")
            for rows, cols in SHAPES:
                schedules, route_of, gemv = family(fmt)
                route = route_of(fmt, rows, cols, width)
                copies = weight_copies(fmt, rows, cols, dev, at_least=3)
                xa = quantize_activation(torch.randn(width, cols, device=dev, dtype=torch.bfloat16))
                times = {n: graph_us([lambda w=w, n=n, g=gemv, f=fmt, x=xa, r=rows: g(w, f, x, r, n)
                                      for w in copies])
                         for n in dict.fromkeys([route.name, *names])}
                best = min(names, key=times.get)
                nbytes = copies[0].numel()
                line = (f"{fmt} {rows}x{cols} w{width}: route {route.name} {times[route.name]:.1f} us "
                        f"({nbytes / times[route.name] / 1e6:.2f} TB/s); best split {best} {times[best]:.1f} "
                        f"({nbytes / times[best] / 1e6:.2f} TB/s); " + " ".join(f"{n}={t:.1f}" for n, t in
                                                                             times.items()))
                print(line, flush=True)
                rows_out.append((fmt, rows, cols, width, route.name, times[route.name], best, times[best]))
                if times[best] < GAIN * times[route.name]:
                    setting.append(f"rows={fmt}:{rows}x{cols}:{width}:{best}")
                del copies
                torch.cuda.empty_cache()
    print("\n| format | matrix | columns | route | µs | best split-K | µs |")
    print("|---|---|---|---|---|---|---|")
    for fmt, rows, cols, width, route, rt, best, bt in rows_out:
        print(f"| {fmt} | {rows}×{cols} | {width} | {route} | {rt:.1f} | {best} | {bt:.1f} |")
    for fmt in a.formats.split(","):
        picked = "+".join(x for x in setting if x.startswith(f"rows={fmt}:"))
        print(f"sweep {fmt}: {picked or '(none faster)'}")
        if a.sweep_file:
            Path(f"{a.sweep_file}.{fmt}").write_text(picked)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
