"""Where a decode step's time goes: the synthetic model's decode steps (eager, no CUDA graph, so every kernel
is its own launch) under torch.profiler, GPU time per step grouped by kernel name, beside the step's wall
time (and with --graphs its time through CUDA graphs; with --timeline the kernels inside the graphed steps).

    python3 bench/step_profile.py --wtype q4_k --out $OUT   # GPU machine (wheels installed as gpu_bench.sh)
    python3 bench/step_profile.py --synthetic tiny --device cpu --dtype float32 --steps 2   # CPU smoke run
    python3 bench/step_profile.py --wtype q4_k --timeline --columns 4   # the graphed step's kernels
    python3 bench/step_profile.py --wtype iq3_s --timeline --columns 4 --steps 4 --trace 60   # one by one
    python3 bench/step_profile.py --wtype q4_k --sweep NINFER_PDL_LATE=0,NINFER_PDL_LATE=1 --lanes 1,8
        # launch settings A/B/B/A: graph replays (CUDA events) and the suite's aggregate decode
    python3 bench/step_profile.py --wtype q4_k --sweep lookahead=0,lookahead=1 --lanes 1,8
    python3 bench/step_profile.py --wtype q4_k --sweep routes=q4k_r1,routes=current --lanes 8 --prompt 512
    python3 bench/step_profile.py --wtype q4_k --lanes 8 --prompt 512 \\
        --sweep routes=current,frag=q4_k:34816x5120:8:frag_w2_r1_m8_s8,frag=q4_k:5120x17408:8:frag_w4_r1_m8_s8
    python3 bench/step_profile.py --wtype q4_k --lanes 1,8 --prompt 512 --no-rate \
        --sweep attn=2:64,gdn=16:4:256   # decode attention's page runs, the GDN decode tiles
    python3 bench/step_profile.py --wtype q4_k --lanes 1 --prompt 512 --no-rate \
        --sweep skip=,skip=fused._swiglu_kernel   # what a step would save without a kernel (outputs wrong)
    python3 bench/step_profile.py --wtype q4_k --lanes 1 --prompt 512 --no-rate --sweep norm=512,norm=1024

Kernel names are grouped by their prefix before the first '<' or '(' (Triton kernels keep their Python name).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.cli.bench import bench_prompt, make_engine  # noqa: E402
from ninfer.cli.bench_suite import SuiteSizes, aggregate_decode  # noqa: E402
from ninfer.engine.api import GenerationRequest, SamplingParams  # noqa: E402
from ninfer.engine.kv_pool import PAGE_TOKENS  # noqa: E402
from ninfer.engine.scheduler import Round, WorkItem  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_steps(engine, n_prompt: int, steps: int, profile: bool, columns: int = 1, lanes: int = 1):
    """Prefill `lanes` prompts, then run `steps` decode rounds of all of them (under torch.profiler if
    `profile`); returns the profiler (or None) and the mean wall time of a decode round in ms. `columns` >
    1: the rounds are the suite's verification step instead (one lane, `columns` positions, logits of every
    row; the cache is not advanced, as in `bench_suite.step_times`)."""
    handles = []
    for lane in range(lanes):
        ids = bench_prompt(getattr(engine.model, "vocab_size", 1000), n_prompt, seed=1 + lane)
        # lane 0 decodes while the others prefill (one a round): enough tokens that no lane ends in the rounds
        # timed (an ending lane's round gathers the lookahead's tokens through a synchronising copy)
        params = SamplingParams(max_tokens=steps + lanes + 4, temperature=0.0, ignore_eos=True)
        handles.append(engine.submit(GenerationRequest(f"profile-{lane}", ids, params)))
    while any(h.seq.generated < 1 for h in handles):  # prefill up to every lane's first token
        rnd = engine.scheduler.schedule()
        if rnd is not None:
            engine.step(rnd)
    seq = handles[0].seq
    item = WorkItem(seq, seq.lane, (seq.tokens[-1],) * columns, seq.cached, True)
    prof = None
    if profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                  torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        if columns > 1:
            engine.runner.run(Round([item], [], []), all_rows=True)
        else:
            engine.step(engine.scheduler.schedule())
    sync()
    ms = (time.perf_counter() - t0) / steps * 1e3
    if prof is not None:
        prof.__exit__(None, None, None)
    while True:  # finish the request
        rnd = engine.scheduler.schedule()
        if rnd is None:
            break
        engine.step(rnd)
    return prof, ms


def grouped(prof, steps: int) -> list[tuple[str, float, float]]:
    """(kernel group, µs per step, launches per step), largest first."""
    groups: dict[str, list[float]] = {}
    for ev in prof.key_averages():
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        if us <= 0 or ev.device_type != torch.autograd.DeviceType.CUDA:  # host-side events (ops, launches)
            continue
        name = re.split(r"[<(]", ev.key)[0].strip().removeprefix("void ").split("::")[-1]
        g = groups.setdefault(name, [0.0, 0.0])
        g[0] += us / steps
        g[1] += ev.count / steps
    return sorted(((k, v[0], v[1]) for k, v in groups.items()), key=lambda r: -r[1])


def idle_gaps(prof, steps: int, top: int = 12, trace: int = 0) -> dict:
    """The device's idle time between kernels / copies over the profiled rounds: per round the span, busy and
    idle µs, and the largest idle totals by the (kernel before, kernel after) pair; `trace` > 0: the first
    `trace` kernels of the last round one by one (`kernel_trace`)."""
    spans = sorted((ev.time_range.start, ev.time_range.end, re.split(r"[<(]", ev.name)[0].strip()[:48])
                   for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA)
    if not spans:
        return {}
    if trace:
        kernel_trace(spans[-(len(spans) // steps):][:trace])
    pairs: dict[tuple[str, str], list[float]] = {}
    busy, idle, end, before = 0.0, 0.0, spans[0][0], spans[0][2]
    for start, stop, name in spans:
        if start > end:
            gap = start - end
            idle += gap
            if gap > 1.0:
                pairs.setdefault((before, name), [0.0, 0])[0] += gap
                pairs[before, name][1] += 1
        busy += max(0.0, stop - max(start, end))
        if stop >= end:
            end, before = stop, name
    span = end - spans[0][0]
    print(f"\ndevice per round: span {span / steps:.0f} µs, busy {busy / steps:.0f}, idle {idle / steps:.0f} "
          f"({len(spans) / steps:.0f} kernels and copies)")
    print("| idle after | before | µs / round | gaps / round |\n|---|---|---|---|")
    worst = sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]
    for (a, b), (us, n) in worst:
        print(f"| {a} | {b} | {us / steps:.1f} | {n / steps:.1f} |")
    return dict(span_us=span / steps, busy_us=busy / steps, idle_us=idle / steps,
                gaps=[dict(after=a, before=b, us=us / steps, count=n / steps) for (a, b), (us, n) in worst])


def kernel_trace(spans: list[tuple[float, float, str]]) -> None:
    """Kernels (start, end µs, name) in order of their start: when each started and ended against the one
    before — a programmatic dependent launch starts before its predecessor ends (its CTAs resident, waiting),
    so "start" shows when a kernel's CTAs found room and "end − previous end" what it added to the chain."""
    print("\n| # | kernel | start µs | end µs | start − previous end | end − previous end |\n"
          "|---|---|---|---|---|---|")
    t0, previous = spans[0][0], spans[0][0]
    for i, (start, stop, name) in enumerate(spans):
        print(f"| {i} | {name} | {start - t0:.1f} | {stop - t0:.1f} | {start - previous:.1f} | "
              f"{stop - previous:.1f} |")
        previous = stop


def replay_ms(engine, columns: int, replays: int = 40, lanes: int = 1, context: int = 0) -> float:
    """GPU time of one replay of the captured decode graph of `lanes` lanes (`columns` positions each),
    median of 5 runs of `replays` back-to-back replays between CUDA events (no host work inside). The
    profiled requests have finished, so their lanes, pages and GDN slots are free: with `context` = 0 every
    row is the scratch lane (one GDN slot, one KV row: both stay in L2, so a many-lane replay is cheaper
    than the round it stands for); with `context` > 0 lane i reads `context` tokens of its own pages and
    GDN slot i, as the suite's rounds do."""
    graphs, kv = engine.runner.graphs, engine.runner.graphs.kv
    with graphs._on_device(), torch.inference_mode():  # (not captured yet with --no-rate)
        entry = graphs.entry(graphs.padded_size(lanes), columns, context + columns)
    n = entry.ctx.inputs.shape[1] // columns
    rows = [[] for _ in range(5)]
    if context:
        pages = -(-(context + columns) // PAGE_TOKENS)
        for lane in range(n):
            kv.page_tables[lane, :pages] = torch.arange(lane * pages, (lane + 1) * pages, dtype=torch.int32)
        rows = [[0] * n * columns, [context + t for _ in range(n) for t in range(columns)],
                [lane for lane in range(n) for _ in range(columns)]]
        rows += [[p + 1 for p in rows[1]], rows[2]]
    with torch.inference_mode():  # the static inputs are inference tensors
        graphs._stage(entry.ctx.inputs, rows)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(replays):
            entry.graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    if context:
        kv.page_tables[:n].fill_(-1)
    return sorted(times)[2]


# `--sweep routes=<name>`: gemv_frag.MEASURED_ROUTES entries to run instead of the current ones ("current":
# none). "iq3s_r1": iq3_s's before session 17's two-row-tile ones; "q4k_r1": q4_k's on one row tile a warp
# at 8 columns (session 17 run 5's suite), "q4k_r2": on two everywhere (session 16's; the current but
# gate|up and down)
ROUTE_SETS = {
    "current": {},
    "iq3s_r1": {("iq3_s", 34816, 5120): (None, None, "frag_w4_r1_m8_s4"),
                ("iq3_s", 16480, 5120): (None, None, "frag_w4_r1_m8_s8"),
                ("iq3_s", 14336, 5120): (None, None, "frag_w4_r1_m8_s4"),
                ("iq3_s", 5120, 6144): (None, None, "frag_w4_r1_m8_s8")},
    "q4k_r1": {("q4_k", 34816, 5120): (None, None, "frag_w2_r1_m8_s4"),
               ("q4_k", 16480, 5120): (None, "frag_w2_r1_m8_s4_pf", "frag_w1_r1_m8_s2_pf"),
               ("q4_k", 14336, 5120): (None, "frag_w2_r1_m8_s2_pf", "frag_w2_r1_m8_s2_pf"),
               ("q4_k", 5120, 17408): ("frag_w4_r1_m8_s8", "frag_w4_r1_m8_s8", "frag_w2_r1_m8_s8"),
               ("q4_k", 5120, 6144): (None, None, "frag_w2_r1_m8_s8")},
    "q4k_r2": {("q4_k", 34816, 5120): (None, None, "frag_w2_r2_m8_s8"),
               ("q4_k", 5120, 17408): ("frag_w4_r1_m8_s8", "frag_w4_r1_m8_s8", "frag_w2_r2_m8_s8")},
}


def rows_override(value: str) -> tuple[dict, tuple, tuple]:
    """`FMT:ROWSxCOLS:WIDTH:SCHEDULE` → (the rows route table to change, its key, the matrix's route names
    with SCHEDULE at WIDTH's slot), e.g. q4_k:5120x17408:1:rows_n8_m1_b8_w4_r2_s2_ef."""
    from ninfer.kernels import gemv_rows, gemv_rows_iq

    fmt, shape, width, schedule = value.split(":")
    rows, cols = map(int, shape.split("x"))
    module = gemv_rows_iq if fmt == "iq3_s" else gemv_rows
    if schedule not in module.SCHEDULES:
        raise SystemExit(f"rows={value}: not one of {module.__name__}.SCHEDULES")
    table, key = (module._EXACT, (rows, cols)) if fmt == "iq3_s" else (module._EXACT, (fmt, rows, cols))
    shape_class = gemv_rows.shape_class(rows, cols)
    names = list(table.get(key) or (module._ROUTE[shape_class] if fmt == "iq3_s" else
                                    module._ROUTE[fmt, shape_class]))
    names[gemv_rows.width_slot(int(width))] = schedule
    return table, key, tuple(names)


def frag_override(value: str) -> tuple[tuple[str, int, int], int, str | None]:
    """`FMT:ROWSxCOLS:WIDTH:SCHEDULE` (SCHEDULE `none`: the rows kernels) → (MEASURED_ROUTES key, index in its
    tuple, schedule name), e.g. q4_k:34816x5120:8:frag_w2_r1_m8_s8."""
    from ninfer.kernels.gemv_frag import SCHEDULES
    from ninfer.kernels.gemv_rows import width_slot

    fmt, shape, width, schedule = value.split(":")
    rows, cols = map(int, shape.split("x"))
    if int(width) < 2 or (schedule != "none" and schedule not in SCHEDULES):
        raise SystemExit(f"frag={value}: width 2-8, schedule one of gemv_frag.SCHEDULES or none")
    return (fmt, rows, cols), width_slot(int(width)) - 1, None if schedule == "none" else schedule


class _Skipped:
    """Stands for a Triton kernel whose launches are dropped (`--sweep skip=`): `kernel[grid](...)` does
    nothing, so the step runs without it (its consumers read stale data: a timing probe only)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def skip_kernels(names: str) -> list[tuple[object, str, object]]:
    """Replace each `module.kernel` of ninfer.kernels (joined by ":") with `_Skipped`; returns what to put
    back."""
    import importlib

    undo = []
    for name in filter(None, names.split(":")):
        module_name, _, kernel = name.rpartition(".")
        module = importlib.import_module(f"ninfer.kernels.{module_name}")
        undo.append((module, kernel, getattr(module, kernel)))
        setattr(module, kernel, _Skipped())
    return undo


def env_sweep(engine, a, settings: list[str]) -> dict[str, float]:
    """The captured step's GPU time under each launch setting ("NAME=value", several joined by "+", e.g.
    NINFER_PDL_LATE=0; the name `lookahead` sets the engine's decode lookahead, seen by --lanes only; `routes`
    one of ROUTE_SETS; `frag` one matrix's fragment schedule at one width, see `frag_override`; `rows` its
    rows schedule, see `rows_override`; `attn` RUN:SPLITS[:PROGRAMS] the decode attention's
    paged_attention.DECODE_RUN_PAGES, DECODE_SPLITS and DECODE_PROGRAMS; `gdn` BLOCK_V:WARPS:BLOCK_C
    gdn_decode's decode tiles, BLOCK_V for any number of lanes; `skip` module.kernel[:module.kernel…] of
    ninfer.kernels left out of the step, an upper bound on what fusing them away could gain; `norm` the
    decode add + RMSNorm's columns a program), the graphs captured again for each, twice over in
    alternating order (the machine's drift shows as the difference); a setting's environment variables hold
    for it alone (the others' are restored)."""
    import os
    from dataclasses import replace

    from ninfer.kernels import (
        fused,
        gdn_decode,
        gemv_frag,
        gemv_rows,
        gemv_rows_iq,
        paged_attention,
        triton_support,
    )

    current = dict(gemv_frag.MEASURED_ROUTES)
    rows_tables = {id(t): (t, dict(t)) for t in (gemv_rows._EXACT, gemv_rows_iq._EXACT)}
    norm_chunk = fused.NORM_CHUNK
    attn_names = ("DECODE_RUN_PAGES", "DECODE_SPLITS", "DECODE_PROGRAMS")
    attn = tuple(getattr(paged_attention, name) for name in attn_names)

    def set_attn(values) -> None:
        for name, value in zip(attn_names, values, strict=True):
            setattr(paged_attention, name, value)
    gdn_tiles = ("RECURRENT_BLOCK_V_ONE_LANE", "RECURRENT_BLOCK_V", "RECURRENT_WARPS_ONE_LANE",
                 "RECURRENT_WARPS", "CONV_BLOCK_C")
    gdn = {name: getattr(gdn_decode, name) for name in gdn_tiles}
    out: dict[str, list[float]] = {}
    routes = gemv_frag.MEASURED_ROUTES
    environ: dict[str, str | None] = {}  # the variables a setting set, as they were before the sweep

    def restore_environ() -> None:
        for name, value in environ.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    for setting in settings + settings[::-1]:
        restore_environ()  # each setting on its own variables only
        routes.clear()
        routes.update(current)  # each setting's routes start from the current ones
        for table, saved in rows_tables.values():
            table.clear()
            table.update(saved)
        set_attn(attn)
        for name, value in gdn.items():
            setattr(gdn_decode, name, value)
        fused.NORM_CHUNK = norm_chunk
        undo = []
        for assignment in setting.split("+"):
            name, _, value = assignment.partition("=")
            if name == "skip":
                undo += skip_kernels(value)
            elif name == "routes":
                routes.update(ROUTE_SETS[value])
            elif name == "frag":  # one matrix and width on one schedule
                key, slot, schedule = frag_override(value)
                names = list(routes.get(key, (None, None, None)))
                names[slot] = schedule
                routes[key] = tuple(names)
            elif name == "rows":  # one matrix and width on one rows schedule (split-K, bench/split_timing.py)
                table, key, names = rows_override(value)
                table[key] = names
            elif name == "attn":  # decode attention's runs: RUN pages at least, SPLITS programs at most (a
                # sequence and KV head), PROGRAMS at most in all (0: no cap)
                run, splits, *programs = map(int, value.split(":"))
                set_attn((run, splits, *(programs or attn[2:])))
            elif name == "gdn":  # value columns, warps per GDN recurrence program (any lanes); conv channels
                columns, warps, channels = map(int, value.split(":"))
                gdn_decode.RECURRENT_BLOCK_V_ONE_LANE = gdn_decode.RECURRENT_BLOCK_V = columns
                gdn_decode.RECURRENT_WARPS_ONE_LANE = gdn_decode.RECURRENT_WARPS = warps
                gdn_decode.CONV_BLOCK_C = channels
            elif name == "norm":  # columns a program of the decode add + RMSNorm (fused.NORM_CHUNK)
                fused.NORM_CHUNK = int(value)
            elif name == "lookahead":
                engine.config = replace(engine.config, decode_lookahead=value == "1")
            else:
                environ.setdefault(name, os.environ.get(name))
                os.environ[name] = value
        triton_support.reread_launch_settings()
        engine.runner.graphs.clear()  # captured again under the new setting
        decode_steps(engine, a.prompt, 2, False, a.columns)
        ms = replay_ms(engine, a.columns)
        out.setdefault(setting, []).append(ms)
        line = f"  {setting}: graph replay {ms:.3f} ms"
        if a.columns > 1:  # the verification step over a context of --prompt tokens (lane 0's own slot)
            deep = replay_ms(engine, a.columns, context=a.prompt)
            out.setdefault(f"{setting} at {a.prompt}", []).append(deep)
            line += f" ({deep:.3f} ms at {a.prompt} tokens)"
        for c in map(int, filter(None, a.lanes.split(","))):  # the suite's aggregate decode, c lanes
            if a.rate:
                rate = aggregate_decode(engine, SuiteSizes(short_prompt=a.prompt), c, "cuda")
                out.setdefault(f"{setting} C={c}", []).append(-rate)
                line += f", C={c} {rate:.1f} tok/s"
            # the same round as one graph replay (what the host's work adds to it): on the scratch lane, and
            # on the lanes' own GDN slots and pages (what the round's GPU time is)
            ms_c = replay_ms(engine, 1, lanes=c)
            real = replay_ms(engine, 1, lanes=c, context=a.prompt)
            out.setdefault(f"{setting} C={c} replay", []).append(ms_c)
            out.setdefault(f"{setting} C={c} replay, own slots", []).append(real)
            line += (f" (replay {ms_c:.3f} ms = {c / ms_c * 1e3:.1f} tok/s; own slots and {a.prompt}"
                     f" tokens {real:.3f} ms = {c / real * 1e3:.1f} tok/s)")
        print(line, flush=True)
        for module, kernel, original in undo:
            setattr(module, kernel, original)
    restore_environ()
    routes.clear()
    routes.update(current)
    fused.NORM_CHUNK = norm_chunk
    set_attn(attn)
    for name, value in gdn.items():
        setattr(gdn_decode, name, value)
    return {k: min(t) for k, t in out.items()}


def add_model_arguments(p: argparse.ArgumentParser, wtype: str) -> None:
    """The synthetic model a profile loads: --synthetic, --wtype, --device, --dtype."""
    p.add_argument("--synthetic", default="27b")
    p.add_argument("--wtype", default=wtype)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")


def engine_args(a: argparse.Namespace, cuda_graphs: bool | None = None,
                decode_lookahead: bool | None = None) -> SimpleNamespace:
    """`ninfer.cli.bench.make_engine`'s arguments for the model of `add_model_arguments`."""
    return SimpleNamespace(synthetic=a.synthetic, wtype=a.wtype, device=a.device, dtype=a.dtype,
                           quantized_weights=None, cuda_graphs=cuda_graphs, decode_lookahead=decode_lookahead,
                           gdn_state_fp16=False)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p, "q4_k")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--graphs", action="store_true", help="also time CUDA-graph steps")
    p.add_argument("--columns", type=int, default=1,
                   help="profile the suite's verification step of this many positions instead")
    p.add_argument("--sweep", default="",
                   help="time only the graphed step, under each of these comma-separated launch settings "
                        "(NAME=value, several joined by +; e.g. NINFER_PDL_LATE=0,NINFER_PDL_LATE=1; "
                        "lookahead=0,lookahead=1 sets the engine's decode lookahead; "
                        "routes=q4k_r1,routes=current the fragment routes of ROUTE_SETS; "
                        "frag=q4_k:34816x5120:8:frag_w2_r1_m8_s8 one matrix's schedule at one width; "
                        "attn=4:1000 decode attention's runs of >= 4 pages, <= 1000 programs a KV head; "
                        "attn=2:64:512 also <= 512 programs a launch)")
    p.add_argument("--lanes", default="", help="with --sweep: also the suite's aggregate decode at these "
                   "lane counts (comma-separated) under each setting; else the profiled rounds decode this "
                   "many lanes (the largest)")
    p.add_argument("--rate", action=argparse.BooleanOptionalAction, default=True,
                   help="with --sweep --lanes: the suite's aggregate decode too (--no-rate: the replays "
                        "only; on the lanes' own slots they are within 0.1 ms of the suite's round)")
    p.add_argument("--timeline", action="store_true",
                   help="profile the CUDA-graph rounds through the engine (lookahead as configured): the "
                        "kernels inside the graphs by name and the device's idle gaps between them (with "
                        "--graphs, the eager profile follows)")
    p.add_argument("--trace", type=int, default=0,
                   help="with --timeline: the first N kernels of the last profiled round, each one's start "
                        "and end against the previous kernel's end (where a launched-early kernel waited)")
    p.add_argument("--decode-lookahead", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine's decode lookahead (default: the engine's, on CUDA yes); the suite's "
                        "aggregate decode of --lanes and the step wall time see it, graph replays do not")
    p.add_argument("--max-context", type=int, default=4096,
                   help="the engine's max context (its page tables' width: the decode attention's splits); "
                        "the suite's is 16,520")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    rows = {}
    modes = (True,) if a.sweep else (True, False) if a.graphs else (True,) if a.timeline else (False,)
    for graphs in modes:
        # the eager profile counts only its own rounds: no lookahead unless asked for
        lookahead = False if not graphs and a.decode_lookahead is None else a.decode_lookahead
        args = engine_args(a, graphs, lookahead)
        lanes = max([1, *map(int, filter(None, a.lanes.split(",")))])
        # KV for every lane's prompt and the suite's n_gen + lanes tokens at once (else no round has them all)
        kv = SuiteSizes(short_prompt=a.prompt, concurrency=(lanes,)).kv_tokens()
        engine, name = make_engine(args, "bf16", a.max_context, 2048, lanes=lanes,
                                   kv_tokens=max(a.max_context, kv))
        profiled = lanes if not a.sweep else 1
        decode_steps(engine, a.prompt, 2, False, a.columns, profiled)  # compile, capture
        profile = a.timeline if graphs else True
        prof, ms = decode_steps(engine, a.prompt, a.steps, profile, a.columns, profiled)
        rows["graph_ms" if graphs else "eager_ms"] = ms
        print(f"{name}: decode step {ms:.2f} ms ({'CUDA graphs' if graphs else 'eager'}, {profiled} lanes)",
              flush=True)
        if graphs and a.timeline:
            rows["timeline"] = idle_gaps(prof, a.steps, trace=a.trace)
        if graphs and a.sweep and engine.runner.graphs is not None:
            rows["sweep_ms"] = env_sweep(engine, a, a.sweep.split(","))
        if prof is not None:
            table = grouped(prof, a.steps)
            total = sum(r[1] for r in table)
            rows["kernels"] = [dict(name=k, us=us, launches=n) for k, us, n in table]
            # graphed: the kernels inside the replays, so a copy or memset node between two kernels shows
            # (session 36 found one after every lane-layout GEMV this way); busy time includes PDL waits
            print(f"\nGPU time per {'graphed' if graphs else 'eager'} step {total / 1e3:.2f} ms, "
                  f"{sum(r[2] for r in table):.0f} launches")
            print("| kernel | µs / step | % | launches / step |\n|---|---|---|---|")
            for k, us, n in table[:30]:
                print(f"| {k} | {us:.0f} | {100 * us / total:.1f} | {n:.0f} |")
        if prof is not None and not graphs:  # a replay runs no PyTorch ops
            ops = sorted((ev for ev in prof.key_averages() if ev.key.startswith("aten::")),
                         key=lambda ev: -getattr(ev, "device_time_total", 0))
            print("\n| PyTorch op | GPU µs / step | calls / step |\n|---|---|---|")
            for ev in ops[:12]:
                us = getattr(ev, "device_time_total", 0) / a.steps
                print(f"| {ev.key} | {us:.0f} | {ev.count / a.steps:.0f} |")
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"step_profile_{a.wtype}_c{a.columns}.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
