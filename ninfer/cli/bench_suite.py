"""`ninfer-bench --suite issue5`: issue 5's benchmark table measured in one process.

A device-to-device copy (the bandwidth the decode limits are computed from), memory (weights on the device vs
their stored bytes, KV pool, GDN state, torch peak), pp512 + tg128, the 4-column / 1-column step ratio
(verification shape), C = 1/2/4/8 aggregate decode, pp8192, and tg128 at 16K depth. Each row is printed
(flushed) the moment it is measured, beside its issue target, so a run cut short still leaves its numbers;
`--json PATH` is rewritten after every row too.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from ninfer.engine.api import GenerationRequest, SamplingParams
from ninfer.engine.engine import Engine
from ninfer.engine.kv_pool import PAGE_TOKENS, pages_for
from ninfer.engine.memory import GIB, MIB, module_bytes, weights_ratio
from ninfer.engine.scheduler import Round, WorkItem
from ninfer.errors import EngineConfigError

SUITES = ("issue5",)
TG_TARGETS = {"iq3_s": 250.0, "q4_k": 200.0}  # tok/s on the H200 (issue 5)
# ik_llama.cpp on the H200 on the same synthetic files (../shared/ANCHORS.md)
ANCHORS = {"iq3_s": {"pp512": 2469, "pp8192": 2794, "tg": 69.9, "tg_depth": 65.2},
           "q4_k": {"pp512": 2398, "tg": 89.8}}


@dataclass(frozen=True)
class SuiteSizes:
    """Token counts of the suite; `scaled` shrinks the prompts (CPU tests) keeping their proportions."""

    short_prompt: int = 512
    long_prompt: int = 8192
    depth: int = 16384
    n_gen: int = 128
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    repetitions: int = 2  # pp512 / tg128; the long phases run once
    copy_bytes: int = GIB
    step_calls: int = 40  # timed calls per shape of the step-ratio phase (the shapes in turn)

    @classmethod
    def scaled(cls, scale: float, n_gen: int, concurrency: tuple[int, ...], repetitions: int) -> SuiteSizes:
        if not 0 < scale <= 1:
            raise EngineConfigError(f"--suite-scale must be in (0, 1], got {scale}")
        if not concurrency or any(not 1 <= c <= 8 for c in concurrency):
            raise EngineConfigError(f"--concurrency values must be 1..8, got {concurrency}")
        base = cls()
        return cls(max(int(base.short_prompt * scale), 8), max(int(base.long_prompt * scale), 16),
                   max(int(base.depth * scale), 32), n_gen, tuple(sorted(set(concurrency))), repetitions,
                   max(int(base.copy_bytes * scale), MIB), base.step_calls if scale == 1 else 3)

    def context_tokens(self) -> int:
        """max_context the engine needs (the deepest request)."""
        return max(self.depth, self.long_prompt, self.short_prompt + 8) + self.n_gen + max(self.concurrency)

    def kv_tokens(self) -> int:
        """KV capacity: the deepest request, or all lanes of the largest concurrency at once (whole pages)."""
        c = max(self.concurrency)
        return max(self.context_tokens(), c * pages_for(self.short_prompt + self.n_gen + c) * PAGE_TOKENS)


@dataclass
class Row:
    test: str
    value: float | None
    unit: str
    target: str = "-"
    ok: bool | None = None
    note: str = ""


@dataclass
class SuiteReport:
    header: dict
    stream: TextIO
    json_path: Path | None = None
    rows: list[Row] = field(default_factory=list)

    def start(self) -> None:
        self._print(f"| {'test':<26} | {'result':>18} | {'target':>10} | {'':4} | note")
        self._print(f"|{'-' * 28}|{'-' * 20}|{'-' * 12}|{'-' * 6}|------")

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        value = "-" if row.value is None else f"{row.value:,.{3 if abs(row.value) < 10 else 1}f} {row.unit}"
        mark = {True: "ok", False: "MISS", None: ""}[row.ok]
        self._print(f"| {row.test:<26} | {value:>18} | {row.target:>10} | {mark:4} | {row.note}")
        if self.json_path is not None:
            self.json_path.write_text(json.dumps(self.as_dict(), indent=1) + "\n", encoding="utf-8")
        return row

    def as_dict(self) -> dict:
        return {**self.header, "rows": [asdict(r) for r in self.rows]}

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def copy_bandwidth_tb_s(device: str, nbytes: int, calls: int = 10) -> float:
    """Device-to-device copy rate in TB/s, counting read + write (as docs/gpu-notes.md does)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        dst.copy_(src)
    _sync(device)
    seconds = time.perf_counter() - t0
    del src, dst
    if device.startswith("cuda"):  # the peak reported last is the engine's, not these buffers'
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return 2 * nbytes * calls / seconds / 1e12


def drive(engine: Engine, handles: list, device: str) -> list[tuple[int, bool, float]]:
    """Run rounds on this thread until every handle finished; per round (items, all one-token decode, s), s
    the wall time since the previous round ended (scheduling included; a decode lookahead's round launched
    by the step before runs on the device meanwhile, so no synchronisation between rounds)."""
    log, open_handles = [], list(handles)
    _sync(device)
    last = time.perf_counter()
    while open_handles:
        rnd = engine.scheduler.schedule()
        if rnd is not None:
            engine.step(rnd)
            now = time.perf_counter()
            decode_only = all(len(i.token_ids) == 1 and i.sample for i in rnd.items)
            log.append((len(rnd.items), decode_only and bool(rnd.items), now - last))
            last = now
        for h in list(open_handles):
            while (ev := h.next_event(0)) is not None:
                if ev.finish_reason == "error":
                    raise EngineConfigError(f"benchmark request failed: {ev.error}")
                if ev.finish_reason is not None:
                    h.last_event = ev
                    open_handles.remove(h)
                    break
    return log


def _submit(engine: Engine, tag: str, n_prompt: int, max_tokens: int, seed: int):
    from ninfer.cli.bench import bench_prompt

    ids = bench_prompt(engine.model.vocab_size, n_prompt, seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return engine.submit(GenerationRequest(f"{tag}-{seed}", ids, params))


def one_request(engine: Engine, n_prompt: int, n_gen: int, seed: int, device: str):
    handle = _submit(engine, "bench", n_prompt, n_gen, seed)
    drive(engine, [handle], device)
    return handle.last_event


def aggregate_decode(engine: Engine, sizes: SuiteSizes, c: int, device: str) -> float:
    """Aggregate tok/s of the rounds where all c lanes decode: each request gets n + c tokens so that window
    is at least n rounds long (the lanes' prefills are interleaved with the others' decode before it)."""
    # warm-up with c lanes decoding together (a CUDA graph of that batch size is captured outside the timing)
    drive(engine, [_submit(engine, "warm", 16, 2 + c, 1000 + i) for i in range(c)], device)
    handles = [_submit(engine, f"c{c}", sizes.short_prompt, sizes.n_gen + c, 100 * c + i) for i in range(c)]
    rounds = [s for n, decode_only, s in drive(engine, handles, device) if decode_only and n == c]
    if not rounds:
        raise EngineConfigError(f"no round had all {c} lanes decoding; raise -n")
    return c * len(rounds) / sum(rounds)


def step_times(engine: Engine, sizes: SuiteSizes, device: str) -> tuple[float, float]:
    """Median seconds of one decode step with 1 column and with 4 columns (one lane's verification shape:
    4 positions, logits of all 4 rows) at context short_prompt, through the engine's runner. The two shapes
    take turns, so whatever drifts over the phase (the GPU's clocks, what L2 holds) moves both medians alike:
    timed one shape after the other, the 1-column median differed by up to 3 % between three runs on one H100
    whose tg128 differed by 1.1 % the other way (gpu-notes "Session 76")."""
    handle = _submit(engine, "step", sizes.short_prompt, 8, 7)
    while handle.seq.generated < 1:
        rnd = engine.scheduler.schedule()
        if rnd is not None:
            engine.step(rnd)
    seq = handle.seq
    rounds = {width: Round([WorkItem(seq, seq.lane, (seq.tokens[-1],) * width, seq.cached, True)], [], [])
              for width in (1, 4)}
    samples = {width: [] for width in rounds}
    for k in range(sizes.step_calls + 2):
        for width, rnd in rounds.items():
            _sync(device)
            t0 = time.perf_counter()
            engine.runner.run(rnd, all_rows=width > 1)
            _sync(device)
            if k >= 2:  # two warm-up calls per shape
                samples[width].append(time.perf_counter() - t0)
    handle.cancel()
    drive(engine, [handle], device)
    return statistics.median(samples[1]), statistics.median(samples[4])


def memory_rows(engine: Engine, report: SuiteReport, stored_bytes: int | None) -> None:
    device_bytes = module_bytes(engine.model)
    ratio = weights_ratio(device_bytes, stored_bytes)
    ledger = engine.memory_ledger()
    stored = "stored size unknown" if stored_bytes is None else f"{_size(stored_bytes)} stored"
    ok = None if ratio is None else ratio <= 1.03
    report.add(Row("weights on device / stored", ratio, "x", "<= 1.03", ok,
                   f"{_size(device_bytes)} on device, {stored}"))
    report.add(Row("KV pool", ledger.kv_bytes / GIB, "GiB",
                   note=f"{ledger.kv_tokens:,} tokens of {ledger.kv_dtype}"))
    state = "fp16" if engine.config.gdn_state_fp16 else "fp32"
    report.add(Row("GDN state", ledger.gdn_bytes / MIB, "MiB", note=f"{ledger.gdn_slots} slots of {state}"))


@dataclass(frozen=True)
class SuiteRun:
    """What every phase needs: the engine, the sizes, where rows go, and how to judge them."""

    engine: Engine
    sizes: SuiteSizes
    report: SuiteReport
    device: str
    wtype: str
    judge_absolute: bool  # the tok/s targets apply (the synthetic 27B at full sizes on a GPU)
    judge_ratios: bool  # the speed-ratio targets apply (full sizes on a GPU); the memory ratio always does


def run_suite(run: SuiteRun, stored_bytes: int | None) -> SuiteReport:
    """Measure every phase in order of importance, each row as soon as it is known."""
    run.report.start()
    bw = run.report.add(Row("copy bandwidth (r+w)", copy_bandwidth_tb_s(run.device, run.sizes.copy_bytes),
                            "TB/s", note=f"{_size(run.sizes.copy_bytes)} device-to-device")).value
    memory_rows(run.engine, run.report, stored_bytes)
    # bytes read per decode token: every weight but the embedding table (one row of it)
    embedding = module_bytes(run.engine.model.token_embedding)
    step_bytes = None if stored_bytes is None else stored_bytes - embedding
    # warm-up at the short prompt's size: its prefill shapes compiled and autotuned (and the one-lane decode
    # graph captured) before pp512 / tg128 are timed, as phase_long_prefill warms its chunks
    drive(run.engine, [_submit(run.engine, "warm", run.sizes.short_prompt, 2, -1)], run.device)
    tg = phase_short(run, None if step_bytes is None else bw * 1e12 / step_bytes)
    phase_step_ratio(run)
    phase_concurrency(run)
    phase_long_prefill(run)
    phase_depth(run, tg)
    peak = torch.cuda.max_memory_allocated(run.device) if run.device.startswith("cuda") else None
    run.report.add(Row("torch peak allocated", None if peak is None else peak / GIB, "GiB",
                       note="since the copy check: weights, KV, state, activations" if peak else "CUDA only"))
    plan_rows(run)
    return run.report


def plan_rows(run: SuiteRun) -> None:
    """The memory plan against what the run held: the workspace and graph pool measured at start, the
    graphs as captured, and the allocator's peak reserved against the plan's sum (CUDA only)."""
    if not run.device.startswith("cuda"):
        return
    led = run.engine.memory_ledger()
    planned = led.held_bytes
    run.report.add(Row("workspace (widest round)", led.workspace_bytes / MIB, "MiB",
                       note=f"a {run.engine.config.prefill_chunk}-token chunk beside "
                            f"{run.engine.config.max_concurrency - 1} decode rows, measured at start"))
    run.report.add(Row("decode graphs' pool", led.graphs_bytes / MIB, "MiB",
                       note=f"{led.graphs_planned_bytes / MIB:,.0f} MiB planned"))
    run.report.add(Row("allocator slack", led.slack_bytes / MIB, "MiB",
                       note="free bytes beside live blocks at start (no KV tensor can use them)"))
    peak = torch.cuda.max_memory_reserved(run.device)
    run.report.add(Row("peak reserved / planned", peak / planned, "x", "<= 1", peak <= planned,
                       f"{_size(peak)} reserved at most since the copy check; planned: weights, KV, GDN "
                       f"state, workspace, slack, graphs {_size(planned)}"))


def phase_short(run: SuiteRun, limit: float | None) -> float:
    """pp512 and tg128 (decode at context 512..640), the mean of -r requests; returns tg."""
    s, n = run.sizes.short_prompt, run.sizes.n_gen
    anchors, target = ANCHORS.get(run.wtype, {}), TG_TARGETS.get(run.wtype)
    events = [one_request(run.engine, s, n, r, run.device) for r in range(run.sizes.repetitions)]
    run.report.add(Row(f"pp{s}", statistics.fmean(e.prefill_tok_per_s for e in events), "tok/s",
                       note=_anchor(anchors, "pp512", s == 512)))
    tg = statistics.fmean(e.decode_tok_per_s for e in events)
    notes = [_anchor(anchors, "tg", s == 512), f"limit {limit:,.0f} tok/s at that bandwidth" if limit else ""]
    ok = _check(tg, target, run.judge_absolute)
    note = " · ".join(x for x in notes if x)
    run.report.add(Row(f"tg{n} (context {s})", tg, "tok/s", _ge(target), ok, note))
    return tg


def phase_step_ratio(run: SuiteRun) -> None:
    one, four = step_times(run.engine, run.sizes, run.device)
    run.report.add(Row("1-column decode step", one * 1e3, "ms"))
    ok = four / one <= 1.2 if run.judge_ratios else None
    run.report.add(Row("4-column / 1-column step", four / one, "x", "<= 1.2", ok,
                       f"4 columns {four * 1e3:.2f} ms (one lane, 4 positions, logits of 4 rows)"))


def phase_concurrency(run: SuiteRun) -> None:
    agg = {}
    for c in run.sizes.concurrency:
        agg[c] = run.report.add(Row(f"decode C={c} aggregate", aggregate_decode(run.engine, run.sizes, c,
                                                                                run.device), "tok/s",
                                    note=f"{c} lanes x >= {run.sizes.n_gen} rounds")).value
    if 1 in agg and max(agg) > 1:
        top = max(agg)
        target = 5.0 if top == 8 else None
        run.report.add(Row(f"C={top} / C=1 aggregate", agg[top] / agg[1], "x", _ge(target),
                           _check(agg[top] / agg[1], target, run.judge_ratios)))


def phase_long_prefill(run: SuiteRun) -> None:
    p, chunk = run.sizes.long_prompt, run.engine.config.prefill_chunk
    one_request(run.engine, min(p, 2 * chunk), 2, -2, run.device)  # warm the chunk shapes (autotuning)
    pp = one_request(run.engine, p, 2, 10, run.device).prefill_tok_per_s
    note = _anchor(ANCHORS.get(run.wtype, {}), "pp8192", p == 8192)
    run.report.add(Row(f"pp{p}", pp, "tok/s", _ge(5000.0), _check(pp, 5000.0, run.judge_absolute),
                       f"{note} · chunk {chunk}" if note else f"chunk {chunk}"))


def phase_depth(run: SuiteRun, tg: float) -> None:
    d, n = run.sizes.depth, run.sizes.n_gen
    ev = one_request(run.engine, d, n, 20, run.device)
    run.report.add(Row(f"pp{d}", ev.prefill_tok_per_s, "tok/s", note="the depth request's prefill"))
    run.report.add(Row(f"tg{n} at depth {d}", ev.decode_tok_per_s, "tok/s",
                       note=_anchor(ANCHORS.get(run.wtype, {}), "tg_depth", d == 16384)))
    ratio = ev.decode_tok_per_s / tg
    ok = _check(ratio, 0.9, run.judge_ratios)
    run.report.add(Row(f"tg at depth {d} / tg{n}", ratio, "x", ">= 0.9", ok))


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def _ge(target: float | None) -> str:
    return "-" if target is None else f">= {target:,.4g}"


def _check(value: float, target: float | None, applies: bool) -> bool | None:
    return None if target is None or not applies else value >= target


def _anchor(anchors: dict, key: str, applies: bool) -> str:
    return f"ik_llama.cpp {anchors[key]:,}" if applies and key in anchors else ""


def suite_header(args, name: str, wtype: str, sizes: SuiteSizes, engine: Engine,
                 stored_bytes: int | None) -> dict:
    from ninfer.kernels.triton_support import triton

    device = args.device
    gpu = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    return {"suite": args.suite, "model": name, "wtype": wtype or None,
            "device": device, "gpu": gpu, "dtype": args.dtype, "kv_dtype": engine.config.kv_dtype,
            "prefill_chunk": engine.config.prefill_chunk, "torch": torch.__version__,
            "triton": getattr(triton, "__version__", None),
            "sizes": {k: v for k, v in asdict(sizes).items()}, "stored_weight_bytes": stored_bytes,
            "device_weight_bytes": module_bytes(engine.model), "memory": engine.memory_ledger().as_dict()}


def stream_for(output: str) -> TextIO:
    """Rows go to stdout for a table, to stderr when stdout is reserved for the JSON."""
    return sys.stdout if output == "table" else sys.stderr
