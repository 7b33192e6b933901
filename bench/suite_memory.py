"""`ninfer-bench --suite issue5` with the caching allocator's bytes printed after each phase: where the
suite's peak reserved memory passes the engine's plan (gpu-notes "Session 75").

    python3 bench/suite_memory.py --synthetic 27b --wtype iq3_s --device cuda --dtype bfloat16 \
        --suite issue5 -r 2

Takes `ninfer-bench`'s arguments; prints `[memory] ...` lines (MiB) before and after every phase and request
drive, at each step of the start's measurement (`workspace.CudaMeter`: the emptied cache before the widest
round, its growth, the graphs' captures, the slack) and after it, and the plan's terms before the suite's
memory rows.
"""

from __future__ import annotations

import sys

import torch

from ninfer.cli import bench, bench_suite
from ninfer.engine import engine, workspace

MIB = 1 << 20
PHASES = ("phase_short", "phase_step_ratio", "phase_concurrency", "phase_long_prefill", "phase_depth")


def report(tag: str) -> None:
    if not torch.cuda.is_available():
        print(f"[memory] {tag}", flush=True)
        return
    stats = torch.cuda.memory_stats()
    mib = {"reserved": torch.cuda.memory_reserved(), "peak reserved": torch.cuda.max_memory_reserved(),
           "allocated": torch.cuda.memory_allocated(), "peak allocated": torch.cuda.max_memory_allocated()}
    counts = f"segments {stats.get('segment.all.current')}, retries {stats.get('num_alloc_retries')}"
    print(f"[memory] {tag}: " + ", ".join(f"{k} {v / MIB:,.0f}" for k, v in mib.items()) + ", " + counts,
          flush=True)


def plan_first(plan_rows):
    def wrapped(run) -> None:
        led = run.engine.memory_ledger()
        terms = {"weights": led.weights_bytes, "kv": led.kv_bytes, "gdn": led.gdn_bytes,
                 "workspace": led.workspace_bytes, "slack": led.slack_bytes, "graphs": led.graphs_bytes,
                 "graphs planned": led.graphs_planned_bytes, "held": led.held_bytes}
        print("[memory] plan: " + ", ".join(f"{k} {v / MIB:,.0f}" for k, v in terms.items()), flush=True)
        plan_rows(run)
    return wrapped


def around(name: str, fn, before: bool = True):
    """`fn`, printing the allocator's bytes before it (with `before`) and after it (an int result in MiB)."""
    def wrapped(*args, **kwargs):
        if before:
            report(f"before {name}")
        result = fn(*args, **kwargs)
        report(f"after {name}" + (f" = {result / MIB:,.0f}" if isinstance(result, int) else ""))
        return result
    return wrapped


def main(argv: list[str]) -> int:
    for name in ("begin", "grown", "graphs", "other", "slack"):
        setattr(workspace.CudaMeter, name, around(f"meter.{name}", getattr(workspace.CudaMeter, name)))
    engine.measure_workspace = around("measure_workspace", engine.measure_workspace)
    for name in PHASES:
        setattr(bench_suite, name, around(name, getattr(bench_suite, name)))
    bench_suite.drive = around("drive", bench_suite.drive, before=False)
    bench_suite.plan_rows = plan_first(bench_suite.plan_rows)
    return bench.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
