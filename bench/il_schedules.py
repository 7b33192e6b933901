"""The il32 GEMVs under other CTA shapes than `il_schedule` routes: warps a CTA and (tensor-core kernel)
registers a thread, on the 27B's iq3_s matrices. Each schedule is checked against the float64 product of the
dequantised weight, then timed as `bench/gpu_check.py`'s `graph_us` does (one CUDA graph over weight copies
larger than 3× L2), all of a case's schedules twice in the order A B … B A, the routed one first. The
tensor-core kernel's tile splits follow the schedule's CTA slots (`mma_splits`), as the router's do.

    python3 bench/il_schedules.py [--shapes 5120x6144,...] [--widths 3,4,8] [--schedules 10:96,8:80,6:112]
    python3 bench/il_schedules.py --widths 1,2 --schedules 10,12,16       # the dp4a kernel (1-2 columns)

A schedule is WARPS[:REGISTERS] (registers 0 or left out: the kernel's default). Session 38: at 3-8 columns
10 warps of 96 registers were the best on every matrix but 5120×6144 (6 warps of 112: 11.8 → 11.0 µs at 4);
alone faster is not enough: the graphed step decides (the dp4a kernel on 16 warps for 5120×6144 at one column,
8.5 → 7.9 µs alone, made the IQ3_S step 0.10 ms slower).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_check import graph_us, rel_err  # noqa: E402
from bench.il_group256 import il32_activation, il32_copies  # noqa: E402
from ninfer.kernels import gemv_il  # noqa: E402


def schedule(spec: str, width: int, n: int, k: int, group: int) -> gemv_il.IlSchedule:
    """The schedule WARPS[:REGISTERS] of the kernel `il_schedule` takes at this width."""
    warps, _, regs = spec.partition(":")
    if width < 3:
        return gemv_il.IlSchedule(int(warps), group=group, regs=int(regs or 0))
    s = gemv_il.IlSchedule(int(warps), kernel="il_mma", regs=int(regs or 0), group=group)
    return gemv_il.with_mma_splits(s, width, k, n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="34816x5120,16480x5120,5120x17408,5120x6144,14336x5120")
    p.add_argument("--widths", default="3,4,8")
    p.add_argument("--schedules", default="10:96,8:80,7:96,6:112,12:80")
    args = p.parse_args()
    torch.manual_seed(0)
    group, specs, rows, worst = gemv_il.il_group(), args.schedules.split(","), [], 0.0
    for shape in args.shapes.split(","):
        n, k, copies, dense = il32_copies(shape)
        for width in (int(w) for w in args.widths.split(",")):
            xa, fp32, want = il32_activation(width, dense, group)
            cases = {"routed": gemv_il.il_schedule(width, k, n, group)}
            cases |= {spec: schedule(spec, width, n, k, group) for spec in specs}
            for s in cases.values():
                worst = max(worst, rel_err(gemv_il.gemv_il(copies[0], fp32, n, s), want))
            times: dict[str, list[float]] = {name: [] for name in cases}
            for order in (list(cases), list(reversed(cases))):
                for name in order:
                    s = cases[name]
                    calls = [lambda w=w, s=s, xa=xa, n=n: gemv_il.gemv_il(w, xa, n, s) for w in copies]
                    times[name].append(graph_us(calls))
            rows.append((shape, width, {name: sum(t) / 2 for name, t in times.items()},
                         {name: s.name for name, s in cases.items()}))
            print(shape, width, ", ".join(f"{name} ({cases[name].name}) {t[0]:.1f} / {t[1]:.1f} µs"
                                          for name, t in times.items()), flush=True)
        del copies, dense
        torch.cuda.empty_cache()
    print("\n| matrix | columns | routed | " + " | ".join(specs) + " |\n|---|---|---|"
          + "---|" * len(specs))
    for shape, width, us, names in rows:
        print(f"| {shape} | {width} | {us['routed']:.1f} ({names['routed']}) | "
              + " | ".join(f"{us[spec]:.1f}" for spec in specs) + " |")
    if worst > 1e-4:
        raise SystemExit(f"a schedule is off the float64 product by {worst:.1e} (more than 1e-4)")


if __name__ == "__main__":
    main()
