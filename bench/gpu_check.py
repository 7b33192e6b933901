"""One-run GPU check of ninfer's kernels: correctness against the CPU reference, then timings, then a table.

Run on the GPU machine from the repository root (wheels in .whl/ installed first, see docs/gpu-notes.md):

    PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --out $OUT

Every kernel is checked on fresh random inputs at several shapes against the PyTorch reference (float64
matmul of `ninfer.quant.dequantize` for the GGUF kernels, `gdn_decode_reference` / `reference.gdn_chunked`
for Gated DeltaNet). Timings are medians of `triton.testing.do_bench` (L2 flushed between samples) at the
Qwen3.5/3.6/3.8-27B shapes; a whole decode step's weight stream (64 layers + head) is captured in a CUDA
graph and replayed for the tg128 estimate. `--quick` runs only the checks on tiny shapes (works on CPU,
through Triton's interpreter) to test the script itself; `--compile-only` compiles every kernel variant for
sm_90 on any machine (no GPU needed) to catch Triton front-end errors before spending GPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--compile-only" in sys.argv or "--sass" in sys.argv:  # compiled-mode kernels even without a GPU
    os.environ["NINFER_TRITON_COMPILE_CHECK"] = "1"
os.environ.setdefault("NINFER_TRITON_ON_CPU", "1")  # --quick on CPU runs the kernels in the interpreter

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.kernels import gdn_prefill as prefill  # noqa: E402
from ninfer.kernels.gdn_decode import gdn_decode, gdn_decode_reference  # noqa: E402
from ninfer.kernels.gguf_matmul import (  # noqa: E402
    FMA_FORMATS,
    KERNEL_FORMATS,
    SCHEDULES,
    WV_FORMATS,
    default_schedule,
    dequantize_rows,
    quant_matmul,
    random_gguf_weight,
)
from ninfer.quant import FORMATS, dequantize  # noqa: E402

FLOOR_TBPS = 4.24  # measured copy bandwidth of the H200 (ANCHORS.md); re-measured below
HIDDEN, FFN, VOCAB = 5120, 17408, 248320
GDN_SHAPES = {"qkv": (10240, HIDDEN), "z": (6144, HIDDEN), "beta": (48, HIDDEN), "alpha": (48, HIDDEN),
              "out": (HIDDEN, 6144)}
ATTN_SHAPES = {"q": (12288, HIDDEN), "k": (1024, HIDDEN), "v": (1024, HIDDEN), "o": (HIDDEN, 6144)}
MLP_SHAPES = {"gate": (FFN, HIDDEN), "up": (FFN, HIDDEN), "down": (HIDDEN, FFN)}
DECODE_SCHEDULES = {1: ["wv_n16_m1", "wv_n32_m1", "wv_n64_m1", "wv_n16_m1_s2", "wv_n16_m1_s4", "wv_n8_m1_s4",
                        "fma_n16_m1_s4", "fma_n64_m1", "fma_n32_m1_s2", "sub_n32_w2"],
                    4: ["wv_n16_m4", "wv_n8_m4", "wv_n16_m4_s4", "fma_n16_m4_s4", "sub_n32_s4", "sub_n64"],
                    16: ["wv_n8_m16_w8", "sub_n32", "sub_n64", "sub_n32_w2", "sub_n32_s4"]}
PREFILL_SCHEDULES = ["dequant_mm", "sub_n64_m64", "elem_n128_m128_k64_w8"]
L2_BYTES = 60 << 20
WIDTHS = (1, 4)


class Log:
    """Prints progress with elapsed seconds and keeps every record for the JSON file."""

    def __init__(self, out: Path | None, name: str = "gpu_check.json"):
        self.t0 = time.time()
        self.records: list[dict] = []
        self.summary: list[str] = []
        self.out = out
        self.name = name

    def __call__(self, msg: str) -> None:
        print(f"[{time.time() - self.t0:7.1f}s] {msg}", flush=True)

    def record(self, **kw) -> None:
        self.records.append(kw)

    def save(self) -> None:
        if self.out:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / self.name).write_text(json.dumps(self.records, indent=1))


def timing_session(out: Path | None, name: str) -> tuple[Log, torch.device]:
    """A Log writing `out/name`, the device (CUDA when present) and a header line; seeds the RNG from the
    clock so every run checks fresh random inputs."""
    import triton

    log = Log(out, name)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    log(f"torch {torch.__version__}, triton {triton.__version__}, "
        f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}")
    torch.manual_seed(int(time.time()))
    return log, dev


def bench_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def weight_copies(fmt: str, rows: int, cols: int, dev: torch.device, at_least: int = 1) -> list[torch.Tensor]:
    """Random GGUF weights of one shape, enough copies (≥ at_least, ≤ 64) to exceed 3× the L2 when a graph
    rotates over them, so nothing is timed from cache (tiny matrices stay L2-resident: capped launches)."""
    nbytes = rows * cols // FORMATS[fmt].block_elems * FORMATS[fmt].block_bytes
    n = min(64, max(at_least, -(-3 * L2_BYTES // nbytes)))
    return [random_gguf_weight(fmt, rows, cols, dev) for _ in range(n)]


def graph_us(calls: list) -> float:
    """Capture `calls` (closures, each on its own buffers) in one CUDA graph; µs per call over 10 replays.
    The buffers together exceed the L2, as a decode step's weights do, so nothing is timed from cache."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (2 * len(calls)))
    return sorted(times)[len(times) // 2]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def check_gemvs(log: Log, dev: torch.device, label: str, formats: list[str], shapes: list, widths,
                names, gemv) -> bool:
    """Int8-activation GEMV schedules vs their float64 twin on fresh random GGUF rows: `names(fmt, width)`
    the schedules for a width, `gemv(raw, fmt, xa, rows, name)` one call; bf16 output (rounding 2^-9), so a
    relative error over 5e-3 fails. The twin covers the first and last 520 rows (dequantising 17408 rows on
    the CPU takes ~15 s)."""
    from ninfer.kernels.gemv_q8 import quantize_activation

    ok = True
    for fmt in formats:
        worst = 0.0
        for rows, cols in shapes:
            raw = random_gguf_weight(fmt, rows, cols, dev)
            head = min(rows, 520)
            pick = torch.cat([torch.arange(head), torch.arange(max(head, rows - 520), rows)]).to(dev)
            w = dequantize(raw[pick].cpu().reshape(-1), "gguf_" + fmt, (len(pick), cols)).to(dev).double()
            for width in widths:
                xa = quantize_activation(torch.randn(width, cols, device=dev, dtype=torch.bfloat16))
                want = xa.dequantize().to(dev) @ w.t()
                for name in names(fmt, width):
                    out = gemv(raw, fmt, xa, rows, name)[:, pick]
                    err = rel_err(out, want) if bool(torch.isfinite(out).all()) else float("inf")
                    worst = max(worst, err)
                    if err > 5e-3:
                        log(f"check {fmt} {rows}x{cols} w{width} {name}: rel err {err:.2e} FAIL")
            del w
        passed = worst < 5e-3
        ok &= passed
        log(f"check {label} {fmt}: worst rel err vs twin {worst:.2e} {'ok' if passed else 'FAIL'}")
        log.record(kind="check", format=fmt, rel_err=worst, ok=passed)
    return ok


# ---------------------------------------------------------------------------------------------------------
# checks


def check_gemm(log: Log, dev: torch.device, quick: bool, formats=KERNEL_FORMATS) -> bool:
    ok = True
    shapes = [(24, 512)] if quick else [(384, 2048), (1040, 5120)]
    widths = [1, 3] if quick else [1, 2, 4, 16, 40, 300]
    for fmt in formats:
        worst = 0.0
        for rows, cols in shapes:
            raw = random_gguf_weight(fmt, rows, cols, dev)
            w = dequantize(raw.cpu().reshape(-1), "gguf_" + fmt, (rows, cols)).to(dev).double()
            for width in widths:
                x = torch.randn(width, cols, device=dev, dtype=torch.float32 if quick else torch.bfloat16)
                # the wv default route (the CUDA default, q8, is checked against its twin in check_q8)
                names = ["tiny_sub" if quick else default_schedule(width, fmt, rows, cols).name]
                if fmt in FMA_FORMATS and width <= 4:
                    names.append("tiny_fma_m2" if quick else ("fma_n32_m1" if width == 1 else "fma_n32_m4"))
                if fmt in WV_FORMATS and width <= 16:
                    wide = ["wv_n16_m4", "wv_n8_m16_w8"]
                    names += ["tiny_wv_m2"] if quick else (["wv_n16_m1", "wv_n16_m1_s4", "wv_n64_m1"]
                                                           if width == 1 else wide)
                for name in names:
                    out = quant_matmul(raw, fmt, x, rows, schedule=name)
                    err = rel_err(out, x.double() @ w.t())
                    finite = bool(torch.isfinite(out).all())
                    worst = max(worst, err if finite else float("inf"))
        # bf16 output rounding (2^-9) dominates on GPU; fp16 operands add ~3e-4
        passed = worst < 5e-3
        ok &= passed
        log(f"check gemm {fmt:7s} worst rel err {worst:.2e} {'ok' if passed else 'FAIL'}")
        log.record(kind="check", op="gemm", format=fmt, rel_err=worst, ok=passed)
    return ok


def check_gdn(log: Log, dev: torch.device, quick: bool) -> bool:
    ok = True
    cases = [(1, 1, 2, 4, 16, 32), (2, 3, 2, 4, 16, 32)] if quick else \
        [(1, 1, 16, 48, 128, 128), (4, 4, 16, 48, 128, 128), (3, 2, 2, 6, 128, 128)]
    for state_dtype in (torch.float32, torch.float16):
        for B, T, Hk, Hv, Dk, Dv in cases:
            C = 2 * Hk * Dk + Hv * Dv
            slots = B + 2
            inputs = dict(
                mixed_qkv=torch.randn(B, T, C, device=dev).to(torch.bfloat16 if not quick else torch.float32),
                a=torch.randn(B, T, Hv, device=dev), b=torch.randn(B, T, Hv, device=dev),
                conv_weight=torch.randn(C, 4, device=dev) * 0.3,
                a_log=torch.log(torch.rand(Hv, device=dev) * 15 + 1), dt_bias=torch.randn(Hv, device=dev) - 2,
                conv_slots=torch.randn(slots, C, 3, device=dev),
                state_slots=(torch.randn(slots, Hv, Dk, Dv, device=dev) * 0.1).to(state_dtype))
            ids = torch.randperm(slots, device=dev)[:B].to(torch.int32)
            ref_in = {k: v.clone() for k, v in inputs.items()}
            mine = {k: v.clone() for k, v in inputs.items()}
            ref = gdn_decode_reference(**ref_in, slot_ids=ids, num_key_heads=Hk, return_all_states=True)
            out = gdn_decode(**mine, slot_ids=ids, num_key_heads=Hk, return_all_states=True)
            errs = [rel_err(out.output, ref.output), rel_err(out.states.float(), ref.states.float()),
                    rel_err(mine["state_slots"].float(), ref_in["state_slots"].float()),
                    rel_err(mine["conv_slots"], ref_in["conv_slots"])]
            tol = 1e-5 if state_dtype == torch.float32 else 1e-3
            passed = max(errs) < tol
            ok &= passed
            name = f"B{B} T{T} Hk{Hk} Hv{Hv} {str(state_dtype)[6:]}"
            log(f"check gdn_decode {name}: rel errs {', '.join(f'{e:.1e}' for e in errs)} "
                f"{'ok' if passed else 'FAIL'}")
            log.record(kind="check", op="gdn_decode", case=name, rel_errs=errs, ok=passed)
    # the prefill's conv + SiLU + q / k norm in one launch (`prefill_qkv`) against its PyTorch ops
    for L, Hk, Hv, D in [(5, 1, 2, 16), (40, 2, 2, 32)] if quick else [(17, 2, 6, 128), (2048, 16, 48, 128)]:
        C = (2 * Hk + Hv) * D
        x = torch.randn(L, C, device=dev).to(torch.float32 if quick else torch.bfloat16)
        w = torch.randn(C, 4, device=dev) * 0.5
        slot = torch.randn(C, 3, device=dev)
        mine, ref = slot.clone(), slot.clone()
        got = prefill.prefill_qkv(x, w, mine, Hk, D, Hv, D)
        want = prefill.prefill_qkv_reference(x, w, ref, Hk, D, Hv, D)
        errs = [rel_err(a, b) for a, b in zip(got, want, strict=True)] + [rel_err(mine, ref)]
        passed = max(errs) < (1e-6 if quick else 2e-3)  # bf16 outputs: one rounding (2^-9) apart at most
        ok &= passed
        log(f"check prefill_qkv L{L} Hk{Hk} Hv{Hv} D{D}: rel errs {', '.join(f'{e:.1e}' for e in errs)} "
            f"{'ok' if passed else 'FAIL'}")
        log.record(kind="check", op="prefill_qkv", case=f"L{L} Hk{Hk} Hv{Hv} D{D}", rel_errs=errs, ok=passed)
    if not quick and prefill.fla_available():
        T, Hk, Hv, D = 300, 2, 6, 128
        q = torch.nn.functional.normalize(torch.randn(T, Hk, D, device=dev), dim=-1) * D ** -0.5
        k = torch.nn.functional.normalize(torch.randn(T, Hk, D, device=dev), dim=-1)
        v = torch.randn(T, Hv, D, device=dev)
        g = -torch.rand(T, Hv, device=dev) * 0.5
        beta = torch.rand(T, Hv, device=dev)
        s0 = torch.randn(Hv, D, D, device=dev) * 0.1
        o_ref, s_ref = prefill.reference.gdn_chunked(q, k, v, g, beta, s0)
        o, s = prefill.gdn_prefill(q, k, v, g, beta, s0)
        errs = [rel_err(o, o_ref), rel_err(s, s_ref)]
        passed = max(errs) < 5e-3  # fla computes the intra-chunk products with tf32/bf16 dots
        ok &= passed
        verdict = "ok" if passed else "FAIL"
        log(f"check gdn_prefill (fla) T{T}: rel errs {errs[0]:.1e}, {errs[1]:.1e} {verdict}")
        log.record(kind="check", op="gdn_prefill_fla", rel_errs=errs, ok=passed)
    return ok


# ---------------------------------------------------------------------------------------------------------
# timings


def copy_bandwidth(log: Log, dev: torch.device) -> float:
    src = torch.empty(1 << 31, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    tbps = 2 * src.numel() / ms / 1e9
    log(f"copy bandwidth {tbps:.2f} TB/s (read + write)")
    log.record(kind="ceiling", op="copy", tbps=tbps)
    return tbps


def time_gemv(log: Log, dev: torch.device, floor: float, defaults: bool = True,
              formats: tuple[str, ...] = ("iq3_s", "q4_k")) -> dict:
    """Per-shape decode GEMV times (CUDA graph over weight copies > L2): every schedule × widths 1, 4, 16."""
    best: dict = {}
    shapes = sorted(set({**GDN_SHAPES, **ATTN_SHAPES, **MLP_SHAPES}.values()))
    cases = [(fmt, r, c) for fmt in formats for r, c in shapes] + [("q6_k", VOCAB, HIDDEN)]
    for fmt, rows, cols in cases:
        copies = weight_copies(fmt, rows, cols, dev)
        nbytes = copies[0].numel()
        wide = (16,) if (rows, cols) in ((FFN, HIDDEN), (HIDDEN, FFN)) else ()
        widths = (1,) if rows == VOCAB else WIDTHS + wide
        for width in widths:
            x = torch.randn(width, cols, device=dev, dtype=torch.bfloat16)
            times = {}
            for sched in DECODE_SCHEDULES[width]:
                kernel = SCHEDULES[sched].kernel
                if (kernel == "fma" and fmt not in FMA_FORMATS) or (kernel == "wv" and fmt not in WV_FORMATS):
                    continue
                calls = [lambda w=w, sched=sched, fmt=fmt, x=x, rows=rows: quant_matmul(
                    w, fmt, x, rows, schedule=sched) for w in copies]
                times[sched] = graph_us(calls)
            sched = min(times, key=times.get)
            us = times[sched]
            best[(fmt, rows, cols, width)] = (sched, us)
            log(f"gemv {fmt} {rows}x{cols} w{width}: best {sched} {us:.1f} us "
                f"({nbytes / us / 1e6:.2f} TB/s, floor {nbytes / floor / 1e6:.1f} us); "
                + " ".join(f"{k}={v:.1f}" for k, v in times.items()))
            log.record(kind="time", op="gemv", format=fmt, shape=[rows, cols], width=width,
                       us=times, best=sched, bytes=nbytes)
        del copies
    bfs = [torch.randn(FFN, HIDDEN, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    x = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    us = graph_us([lambda bf=bf: x @ bf.t() for bf in bfs])
    log(f"gemv torch bf16 {FFN}x{HIDDEN} w1: {us:.1f} us ({bfs[0].numel() * 2 / us / 1e6:.2f} TB/s)")
    log.record(kind="time", op="gemv_torch_bf16", shape=[FFN, HIDDEN], us=us)
    for fmt in KERNEL_FORMATS if defaults else ():
        copies = [random_gguf_weight(fmt, FFN, HIDDEN, dev) for _ in range(4)]
        us = graph_us([lambda w=w, fmt=fmt: quant_matmul(w, fmt, x, FFN) for w in copies])
        log(f"gemv {fmt} {FFN}x{HIDDEN} w1 default: {us:.1f} us ({copies[0].numel() / us / 1e6:.2f} TB/s)")
        log.record(kind="time", op="gemv_default", format=fmt, shape=[FFN, HIDDEN], us=us,
                   bytes=copies[0].numel())
    return best


def time_prefill_gemm(log: Log, dev: torch.device) -> None:
    rows, cols = FFN, HIDDEN
    for fmt in ("iq3_s", "q4_k"):
        raw = random_gguf_weight(fmt, rows, cols, dev)
        for m in (512, 2048, 8192):
            x = torch.randn(m, cols, device=dev, dtype=torch.bfloat16)
            times = {s: bench_ms(lambda s=s, raw=raw, fmt=fmt, x=x: quant_matmul(
                raw, fmt, x, rows, schedule=s)) * 1e3 for s in PREFILL_SCHEDULES}
            sched = min(times, key=times.get)
            tflops = 2 * m * rows * cols / times[sched] / 1e6
            log(f"prefill gemm {fmt} {rows}x{cols} m{m}: best {sched} {times[sched]:.0f} us = {tflops:.0f} "
                f"TFLOP/s; " + " ".join(f"{k}={v:.0f}" for k, v in times.items()))
            log.record(kind="time", op="prefill_gemm", format=fmt, m=m, us=times, tflops=tflops)
        us = bench_ms(lambda raw=raw, fmt=fmt: dequantize_rows(raw, fmt, rows, cols)) * 1e3
        log(f"dequantize_rows {fmt} {rows}x{cols} -> bf16: {us:.0f} us")
        log.record(kind="time", op="dequantize_rows", format=fmt, us=us)
    w = torch.randn(rows, cols, device=dev, dtype=torch.bfloat16)
    for m in (512, 2048, 8192):
        x = torch.randn(m, cols, device=dev, dtype=torch.bfloat16)
        us = bench_ms(lambda x=x: x @ w.t()) * 1e3
        log(f"prefill gemm torch bf16 m{m}: {us:.0f} us = {2 * m * rows * cols / us / 1e6:.0f} TFLOP/s")
        log.record(kind="time", op="prefill_gemm_torch_bf16", m=m, us=us)


def gdn_inputs(dev, B, T, state_dtype, slots=None):
    Hk, Hv, D = 16, 48, 128
    C = 2 * Hk * D + Hv * D
    slots = slots or B
    return dict(mixed_qkv=torch.randn(B, T, C, device=dev, dtype=torch.bfloat16),
                a=torch.randn(B, T, Hv, device=dev), b=torch.randn(B, T, Hv, device=dev),
                conv_weight=torch.randn(C, 4, device=dev) * 0.3,
                a_log=torch.log(torch.rand(Hv, device=dev) * 15 + 1), dt_bias=torch.randn(Hv, device=dev) - 2,
                conv_slots=torch.randn(slots, C, 3, device=dev),
                state_slots=(torch.randn(slots, Hv, D, D, device=dev) * 0.1).to(state_dtype))


def time_gdn(log: Log, dev: torch.device) -> dict:
    """GDN decode per layer: 48 launches (one per GDN layer, each its own state slots) in a CUDA graph."""
    out = {}
    for state_dtype in (torch.float32, torch.float16):
        for B, T in ((1, 1), (4, 1), (8, 1), (1, 4)):
            inp = gdn_inputs(dev, B, T, state_dtype, slots=48 * B)
            ids = [torch.arange(i * B, (i + 1) * B, device=dev, dtype=torch.int32) for i in range(48)]
            us = graph_us([lambda i=i, inp=inp: gdn_decode(**inp, slot_ids=i, num_key_heads=16) for i in ids])
            state_bytes = 2 * B * inp["state_slots"][0].numel() * inp["state_slots"].element_size()
            name = f"B{B} T{T} {str(state_dtype)[6:]}"
            out[name] = us
            log(f"gdn_decode {name}: {us:.1f} us/layer (state r+w {state_bytes / 1e6:.1f} MB, "
                f"floor {state_bytes / FLOOR_TBPS / 1e6:.1f} us)")
            log.record(kind="time", op="gdn_decode", case=name, us=us, state_bytes=state_bytes)
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as e:  # fla missing: report and go on
        log(f"fla-core not importable ({e}); skipping fla timings")
        return out
    for B in (1, 8):
        q = torch.randn(B, 1, 16, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B, 1, 16, 128, device=dev, dtype=torch.bfloat16)
        v = torch.randn(B, 1, 48, 128, device=dev, dtype=torch.bfloat16)
        g = -torch.rand(B, 1, 48, device=dev)
        beta = torch.rand(B, 1, 48, device=dev, dtype=torch.bfloat16)
        h0 = torch.randn(B, 48, 128, 128, device=dev)
        us = graph_us([lambda q=q, k=k, v=v, g=g, beta=beta, h0=h0: fused_recurrent_gated_delta_rule(
            q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
            use_qk_l2norm_in_kernel=True)] * 8)
        log(f"fla fused_recurrent B{B}: {us:.1f} us/layer")
        log.record(kind="time", op="fla_fused_recurrent", batch=B, us=us)
    for T in (1024, 8192):
        q = torch.randn(1, T, 16, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, T, 16, 128, device=dev, dtype=torch.bfloat16)
        v = torch.randn(1, T, 48, 128, device=dev, dtype=torch.bfloat16)
        g = -torch.rand(1, T, 48, device=dev) * 0.1
        beta = torch.rand(1, T, 48, device=dev, dtype=torch.bfloat16)
        us = bench_ms(lambda q=q, k=k, v=v, g=g, beta=beta: chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)) * 1e3
        log(f"fla chunk prefill T{T}: {us:.0f} us/layer ({T * 1e6 / us / 48:.0f} tok/s over 48 GDN layers)")
        log.record(kind="time", op="fla_chunk", tokens=T, us=us)
    return out


def decode_step_graph(log: Log, dev: torch.device, fmt: str, best: dict, width: int, state_dtype,
                      q8: bool = False) -> float:
    """All 27B decode GEMVs (64 layers + head) and 48 GDN decode steps in one CUDA graph: ms per step.
    `q8`: the int8 activation is re-quantised where the model has a new activation (first projection of
    each group: qkv/q, out/o, gate, down, head), as the memo does in the model."""
    from ninfer.kernels import gemv_q8

    gen_layers = []
    for i in range(64):
        shapes = {**(ATTN_SHAPES if i % 4 == 3 else GDN_SHAPES), **MLP_SHAPES}
        gen_layers.append([(random_gguf_weight(fmt, r, c, dev), r, c, name in ("qkv", "q", "out", "o", "gate",
                                                                                "down"))
                           for name, (r, c) in shapes.items()])
    head = random_gguf_weight("q6_k", VOCAB, HIDDEN, dev)
    weight_bytes = sum(w.numel() for layer in gen_layers for w, _, _, _ in layer) + head.numel()
    xs = {c: torch.randn(width, c, device=dev, dtype=torch.bfloat16) for c in (HIDDEN, 6144, FFN)}
    gdn = gdn_inputs(dev, width, 1, state_dtype, slots=48 * width)
    ids = [torch.arange(i * width, (i + 1) * width, device=dev, dtype=torch.int32) for i in range(48)]

    def step():
        j = 0
        for i, layer in enumerate(gen_layers):
            for w, r, c, fresh in layer:
                if q8 and fresh:
                    gemv_q8._MEMO.clear()
                sched = best.get((fmt, r, c, width), ("sub_n32",))[0]
                quant_matmul(w, fmt, xs[c], r, schedule=sched)
            if i % 4 != 3:
                gdn_decode(**gdn, slot_ids=ids[j], num_key_heads=16)
                j += 1
        head_sched = best.get(("q6_k", VOCAB, HIDDEN, 1), ("sub_n32_w2",))[0]  # run 2's best
        if q8:
            gemv_q8._MEMO.clear()
            head_sched = best.get(("q6_k", VOCAB, HIDDEN, width), (head_sched,))[0]
        quant_matmul(head, "q6_k", xs[HIDDEN], VOCAB, schedule=head_sched)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.time()
    n = 20
    for _ in range(n):
        graph.replay()
    torch.cuda.synchronize()
    ms = (time.time() - t0) * 1e3 / n
    log(f"decode step graph {fmt}{' q8' if q8 else ''} width {width} ({str(state_dtype)[6:]} state): "
        f"{ms:.3f} ms/step = "
        f"{1e3 / ms:.0f} steps/s; weights {weight_bytes / 1e9:.2f} GB -> {weight_bytes / ms / 1e9:.2f} TB/s "
        f"(limit {1e3 / (weight_bytes / FLOOR_TBPS / 1e9):.0f} steps/s)")
    log.record(kind="time", op="decode_step_graph", format=fmt, width=width, ms=ms, weight_bytes=weight_bytes)
    return ms


def random_kv_pages(dev, fmt, kv_heads: int, lens: list[int], spare: int = 2):
    """Random K/V of sequences of `lens` tokens (lane i holds lens[i]) on shuffled pages among `spare` pages
    of garbage bytes; returns (storage, page tables)."""
    from ninfer.kernels import kv_quant

    D = fmt.head_dim
    pages = sum(-(-n // 64) for n in lens) + spare
    storage = torch.randint(0, 256, (pages, kv_heads, 64, fmt.token_bytes), dtype=torch.uint8, device=dev)
    tables = torch.full((len(lens), max(-(-n // 64) for n in lens)), -1, dtype=torch.int32, device=dev)
    perm = torch.randperm(pages).tolist()
    for lane, n in enumerate(lens):
        ids = [perm.pop() for _ in range(-(-n // 64))]
        tables[lane, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k, v = (torch.randn(len(ids), kv_heads, 64, D, device=dev) for _ in range(2))
        storage[torch.tensor(ids, device=dev)] = kv_quant.encode_kv(fmt, k, v)
    return storage, tables


def check_and_time_attention(log: Log, dev: torch.device, quick: bool) -> bool:
    """Paged decode and prefill attention vs their references on the same bytes; then their timings."""
    ok = check_and_time_decode_attention(log, dev, quick)
    return check_and_time_prefill_attention(log, dev, quick) and ok


def check_and_time_decode_attention(log: Log, dev: torch.device, quick: bool) -> bool:
    """Paged decode attention vs the reference on the same bytes; then µs per layer at 16K context."""
    from ninfer.kernels import kv_quant
    from ninfer.kernels.paged_attention import paged_decode_attention, paged_decode_attention_reference

    ok = True
    Hq, Hkv, D = (4, 2, 64) if quick else (24, 4, 256)
    for name in ("bf16", "int8", "rk8v4", "rk4v4"):
        fmt = kv_quant.kv_format(name, D)
        lens = [70, 5] if quick else [1000, 64, 333]
        storage, tables = random_kv_pages(dev, fmt, Hkv, lens)
        ids = torch.arange(len(lens), device=dev, dtype=torch.int32).flip(0)
        seq = torch.tensor(lens, device=dev, dtype=torch.int32).flip(0)
        q = torch.randn(len(lens), Hq, D, device=dev, dtype=torch.bfloat16)
        ref = paged_decode_attention_reference(q.float(), storage, tables, ids, seq, fmt)
        out = paged_decode_attention(q.float(), storage, tables, ids, seq, fmt)
        err = rel_err(out, ref)
        passed = bool(torch.isfinite(out).all()) and err < 5e-3  # tf32 dots on the GPU
        ok &= passed
        log(f"check paged attention {name}: rel err {err:.1e} {'ok' if passed else 'FAIL'}")
        log.record(kind="check", op="paged_attention", format=name, rel_err=err, ok=passed)
        if quick:
            continue
        ctx = 16384
        n_pages = ctx // 64
        big = torch.randint(0, 256, (16 * n_pages, Hkv, 64, fmt.token_bytes), dtype=torch.uint8, device=dev)
        big[..., fmt.key_bytes - 2 * (D // 64):fmt.key_bytes] = 0  # finite scales: zero keeps them valid
        layer_tables = [torch.arange(i * n_pages, (i + 1) * n_pages, device=dev, dtype=torch.int32)[None]
                        for i in range(16)]
        one = torch.zeros(1, device=dev, dtype=torch.int32)
        lens16 = torch.full((1,), ctx, device=dev, dtype=torch.int32)
        q1 = torch.randn(1, Hq, D, device=dev, dtype=torch.bfloat16)
        floor = n_pages * 64 * Hkv * fmt.token_bytes / FLOOR_TBPS / 1e6
        # the engine's tables are max_context wide: 4096 pages (256K) leaves 15/16 of the splits empty
        for width, per_split in ((n_pages, 1), (n_pages, 2), (n_pages, 4), (n_pages, 8), (4096, 4)):
            tables = [torch.cat([t, torch.full((1, width - n_pages), -1, device=dev, dtype=torch.int32)], 1)
                      for t in layer_tables]
            calls = [lambda t=t, big=big, fmt=fmt, q1=q1, one=one, n=lens16, s=per_split:
                     paged_decode_attention(q1, big, t, one, n, fmt, pages_per_split=s) for t in tables]
            us = graph_us(calls)
            log(f"paged attention {name} 16K context, batch 1, {per_split} pages per split, table {width} "
                f"pages: {us:.1f} us/layer (floor {floor:.1f} us, {us / floor:.1f}x)")
            log.record(kind="time", op="paged_attention", format=name, context=ctx, us=us,
                       pages_per_split=per_split, table_pages=width)
    return ok


PREFILL_ATTN_TILES = ((64, 8), (128, 8), (64, 4))  # (query rows per program, warps) swept at D = 256


def check_and_time_prefill_attention(log: Log, dev: torch.device, quick: bool) -> bool:
    """Prefill (flash) attention of a span vs its reference on the same pool bytes (fp16 dots on the GPU),
    then TFLOP/s of a 2048-token chunk at the 27B's shapes (Hq 24, Hkv 4, D 256) after 0..14336 cached."""
    from ninfer.kernels import kv_quant
    from ninfer.kernels.prefill_attention import prefill_attention, prefill_attention_reference

    ok = True
    Hq, Hkv, D = (4, 2, 64) if quick else (24, 4, 256)
    cases = [(0, 40), (70, 9)] if quick else [(0, 300), (1000, 77), (130, 512)]  # (cached, chunk)
    for name in ("bf16", "int8", "rk8v4", "rk4v4"):
        fmt = kv_quant.kv_format(name, D)
        for cached, length in cases:
            storage, tables = random_kv_pages(dev, fmt, Hkv, [5, cached + length])
            q = torch.randn(length, Hq, D, device=dev)
            ref = prefill_attention_reference(q, storage, tables, 1, cached, fmt)
            out = prefill_attention(q, storage, tables, 1, cached, fmt, dot_f16=True)
            err = rel_err(out, ref)
            passed = bool(torch.isfinite(out).all()) and err < 3e-3  # fp16 dot operands: CPU 2.5e-4..5.1e-4
            ok &= passed
            log(f"check prefill attention {name} cached {cached} chunk {length}: rel err {err:.1e} "
                f"{'ok' if passed else 'FAIL'}")
            log.record(kind="check", op="prefill_attention", format=name, cached=cached, chunk=length,
                       rel_err=err, ok=passed)
        if not quick:
            time_prefill_attention(log, dev, fmt, Hq, Hkv)
    return ok


def time_prefill_attention(log: Log, dev: torch.device, fmt, Hq: int, Hkv: int) -> None:
    """ms and TFLOP/s (causal FLOPs: 4·D per visible query-key pair and head) of a 2048-token chunk, per tile;
    the pp8192 estimate sums the four 2048-token chunks of an 8192-token prompt over 16 attention layers."""
    from ninfer.kernels.prefill_attention import prefill_attention

    D, L = fmt.head_dim, 2048
    storage, tables = random_kv_pages(dev, fmt, Hkv, [16384], spare=0)
    q = torch.randn(L, Hq, D, device=dev, dtype=torch.bfloat16)
    best = None
    for rows, warps in PREFILL_ATTN_TILES:
        times = {}
        for cached in (0, 2048, 4096, 6144, 14336):
            times[cached] = bench_ms(lambda c=cached, r=rows, w=warps: prefill_attention(
                q, storage, tables, 0, c, fmt, block_rows=r, num_warps=w))
            tflops = 4 * D * Hq * (L * cached + L * (L + 1) / 2) / times[cached] / 1e9
            log.record(kind="time", op="prefill_attention", format=fmt.name, block_rows=rows, warps=warps,
                       cached=cached, chunk=L, ms=times[cached], tflops=tflops)
            if cached in (0, 14336):
                log(f"prefill attention {fmt.name} r{rows} w{warps} chunk {L} after {cached}: "
                    f"{times[cached]:.3f} ms = {tflops:.0f} TFLOP/s")
        pp8192 = 16 * sum(times[c] for c in (0, 2048, 4096, 6144))
        log(f"prefill attention {fmt.name} r{rows} w{warps}: pp8192 (16 layers, 2048-token chunks) "
            f"{pp8192:.1f} ms")
        if best is None or pp8192 < best[0]:
            best = (pp8192, rows, warps)
    log.record(kind="time", op="prefill_attention_pp8192", format=fmt.name, ms=best[0], block_rows=best[1],
               warps=best[2])
    for span in (2, 4, 8):  # verification spans at 16K: the context split over programs, merged
        qs = q[:span].contiguous()
        ms = bench_ms(lambda qs=qs, n=span: prefill_attention(qs, storage, tables, 0, 16384 - n, fmt))
        log(f"prefill attention {fmt.name} span {span} after {16384 - span} (split context): "
            f"{ms * 1e3:.1f} us")
        log.record(kind="time", op="prefill_attention_span", format=fmt.name, span=span, us=ms * 1e3)
    if fmt.name == "bf16":  # the path the engine took before: decode every page to fp32, SDPA with a mask
        from ninfer.engine.paged_context import causal_attention
        from ninfer.kernels import kv_quant

        def gathered():
            rows = storage[tables[0].long()].transpose(0, 1).reshape(Hkv, -1, fmt.token_bytes)
            k, v = kv_quant.decode_kv(fmt, rows[:, : 14336 + L])
            return causal_attention(q.float(), k, v, 14336)

        ms = bench_ms(gathered)
        log(f"prefill attention bf16 chunk {L} after 14336, gathered fp32 + SDPA (the old path): {ms:.3f} ms")
        log.record(kind="time", op="prefill_attention_gathered", format="bf16", cached=14336, ms=ms)


def compile_attention(log: Log) -> bool:
    """Compile the paged decode (+ merge) and prefill attention kernels of every KV dtype for sm_90 at the
    27B's head dim, pointers hinted 16-byte aligned as Triton specialises them at run time."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ninfer.kernels import kv_quant
    from ninfer.kernels import paged_attention as pa
    from ninfer.kernels import prefill_attention as pf

    ok = True

    def build(fn, sig, const, name, warps=4):
        nonlocal ok
        aligned = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
        try:
            triton.compile(ASTSource(fn, {**sig, **dict.fromkeys(const, "constexpr")}, const, aligned),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
            log(f"compile {name}: ok")
        except Exception as e:  # report every failure, keep going
            ok = False
            log(f"compile {name}: FAILED {type(e).__name__}: {str(e).splitlines()[-1] if str(e) else ''}")

    attn = {"q_ptr": "*fp32", "kv_ptr": "*u8", "kv16_ptr": "*i16", "pt_ptr": "*i32", "lane_ptr": "*i32",
            "len_ptr": "*i32", "levels_ptr": "*fp32", "acc_ptr": "*fp32", "ml_ptr": "*fp32", "Hq": "i32",
            "Hkv": "i32", "pt_stride": "i32", "pages_per_split": "i32", "scale": "fp32"}
    merge = {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "len_ptr": "*i32", "out_ptr": "*bf16",
             "gate_ptr": "*bf16", "q_ptr": "*i8", "d_ptr": "*fp32", "s_ptr": "*fp32", "Hq": "i32",
             "pages_per_split": "i32", "s_gate": "i32"}
    for gate in (False, True):
        const = {"D": 256, "SPLITS": 64, "BS": 64, "GATE": gate, "QUANT": gate, "GROUP": 256}
        build(pa._merge_splits_kernel, merge, const, f"paged attention merge{' + gate' if gate else ''}")
    prefill = {"q_ptr": "*bf16", "kv_ptr": "*u8", "kv16_ptr": "*i16", "pt_ptr": "*i32", "levels_ptr": "*fp32",
               "o_ptr": "*bf16", "acc_ptr": "*fp32", "ml_ptr": "*fp32", "L": "i32", "cached": "i32",
               "Hq": "i32", "Hkv": "i32", "pages_per_split": "i32", "scale": "fp32"}
    for name, code in pa.KERNEL_KV_CODES.items():
        fmt = kv_quant.kv_format(name, 256)
        rows = {"KB": fmt.key_bytes, "TB": fmt.token_bytes}
        const = {"FMT": code, "D": 256, "G": 6, "GPAD": 16, **rows, "SPLITS": 64}
        build(pa._paged_decode_kernel, attn if fmt.rotated_keys else {**attn, "q_ptr": "*bf16"}, const,
              f"paged attention {name}")
        sig = {**prefill, "q_ptr": "*fp32"} if fmt.rotated_keys else prefill  # rotated queries are fp32
        for block_rows, warps in PREFILL_ATTN_TILES:
            const = {"FMT": code, "D": 256, "G": 6, **rows, "BLOCK_R": block_rows, "DOT_F16": True,
                     "SPLITS": 1}
            build(pf._prefill_kernel, sig, const, f"prefill attention {name} r{block_rows} w{warps}", warps)
        const = {"FMT": code, "D": 256, "G": 6, **rows, "BLOCK_R": 64, "DOT_F16": True, "SPLITS": 64}
        build(pf._prefill_kernel, sig, const, f"prefill attention {name} r64 w8, 64 splits", 8)
    return ok


def compile_all(log: Log) -> bool:
    """Compile every kernel × format × tile variant the routes use for sm_90 (Triton front end + ptxas)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ninfer.kernels import gdn_decode as gd
    from ninfer.kernels import gguf_matmul as gm

    target = GPUTarget("cuda", 90, 32)
    ok = True

    def build(fn, sig, const, name, warps=4):
        nonlocal ok
        try:
            triton.compile(ASTSource(fn, {**sig, **dict.fromkeys(const, "constexpr")}, const), target=target,
                           options={"num_warps": warps})
            log(f"compile {name}: ok")
        except Exception as e:  # report every failure, keep going
            ok = False
            log(f"compile {name}: FAILED {type(e).__name__}: {str(e).splitlines()[-1] if str(e) else ''}")

    mm = {"w_ptr": "*u8", "w32_ptr": "*i32", "x_ptr": "*bf16", "y_ptr": "*bf16", "grid_ptr": "*i32",
          "levels_ptr": "*fp32", "N": "i32", "K": "i32", "M": "i32", "row_bytes": "i32", "stride_xm": "i32",
          "stride_ym": "i32"}
    for fmt in KERNEL_FORMATS:
        f = FORMATS[fmt]
        geo = dict(FMT=gm.FORMAT_CODES[fmt], QK=f.block_elems, BB=f.block_bytes)
        build(gm._gguf_matmul_sub_kernel, mm, {**geo, "BLOCK_N": 32, "BLOCK_M": 16, "SPLIT_K": 1,
                                               "DOT_F16": True}, f"sub {fmt}")
        fma_sig = {k: v for k, v in mm.items() if k != "levels_ptr"}
        if fmt in FMA_FORMATS:
            build(gm._gemv_fma_kernel, fma_sig, {**geo, "BLOCK_N": 16, "BLOCK_M": 4, "SPLIT_K": 4},
                  f"fma {fmt}")
        if fmt in gm.WV_FORMATS:
            for sc in sorted({s for s in gm.SCHEDULES.values() if s.kernel == "wv"}, key=str):
                tiles = {"BLOCK_N": sc.block_n, "BLOCK_M": sc.block_m, "SPLIT_K": sc.split_k}
                tiles["QK"], tiles["BB"] = gm.wv_geometry(fmt)
                units = "*i16" if fmt == "q8_0" else "*i32"  # q8_0 rows are read as int16
                build(gm._gemv_wv_kernel, {**fma_sig, "w32_ptr": units, "row_words": "i32"}, {**geo, **tiles},
                      f"wv {fmt} {sc.name}", warps=sc.num_warps)
    build(gd._conv_kernel, {"x_ptr": "*bf16", "w_ptr": "*fp32", "conv_ptr": "*fp32", "slot_ptr": "*i32",
                            "y_ptr": "*fp32", "conv_all_ptr": "*fp32", "T": "i32", "C": "i32", "s_xb": "i32",
                            "s_xt": "i32", "s_cs": "i32", "s_cc": "i32"}, {"BLOCK_C": 256, "STORE_ALL": True},
          "gdn conv")
    rec = {"y_ptr": "*fp32", "a_ptr": "*fp32", "b_ptr": "*fp32", "alog_ptr": "*fp32", "dtb_ptr": "*fp32",
           "state_ptr": "*fp16", "slot_ptr": "*i32", "o_ptr": "*fp32", "all_ptr": "*fp16", "T": "i32",
           "C": "i32", "Hv": "i32", "s_ab": "i32", "s_at": "i32", "s_ss": "i32", "s_sh": "i32"}
    build(gd._recurrent_kernel, rec,
          {"HK": 16, "DK": 128, "DV": 128, "BLOCK_V": 32, "STORE_ALL": True}, "gdn recurrent")
    ok &= compile_attention(log)
    return ok


def sass_counts(log: Log) -> bool:
    """SASS instructions per weight in the main loop of each 1-column wv schedule, compiled for sm_90 on any
    machine (pointer/size arguments hinted 16-divisible, as Triton specialises them at run time)."""
    from sass_tools import compile_sm90, cuobjdump, loop_body, opcode_mix

    from ninfer.kernels import gguf_matmul as gm

    sig = {"w_ptr": "*u8", "w32_ptr": "*i32", "x_ptr": "*bf16", "y_ptr": "*bf16", "grid_ptr": "*i32",
           "N": "i32", "K": "i32", "M": "i32", "row_bytes": "i32", "stride_xm": "i32", "stride_ym": "i32",
           "row_words": "i32"}
    hinted = ("w_ptr", "w32_ptr", "x_ptr", "y_ptr", "grid_ptr", "K", "row_bytes", "row_words", "stride_xm",
              "stride_ym")
    for fmt in gm.WV_FORMATS:
        for sc in [s for s in gm.SCHEDULES.values() if s.kernel == "wv" and s.block_m == 1]:
            qk, bb = gm.wv_geometry(fmt)
            const = dict(FMT=gm.FORMAT_CODES[fmt], QK=qk, BB=bb, BLOCK_N=sc.block_n, BLOCK_M=1,
                         SPLIT_K=sc.split_k)
            units = {"w32_ptr": "*i16"} if fmt == "q8_0" else {}  # q8_0 rows are read as int16
            c = compile_sm90(gm._gemv_wv_kernel, {**sig, **units}, const, hinted, sc.num_warps, sc.num_stages)
            body = loop_body(cuobjdump(c, "-sass"))
            if not body:
                log(f"sass wv {fmt} {sc.name}: no loop found")
                continue
            per_thread = sc.block_n * qk / (32 * sc.num_warps)
            top = " ".join(f"{k} {v}" for k, v in opcode_mix(body).most_common(8))
            log(f"sass wv {fmt} {sc.name}: {len(body)} instructions per block loop = "
                f"{len(body) / per_thread:.1f} per weight; {top}")
    return True


# ---------------------------------------------------------------------------------------------------------
# int8-activation ("q8") dp4a GEMV (ninfer/kernels/gemv_q8.py): check, sweep, decode-step graphs, SASS

Q8_SWEEP = {1: ["q8_n8_m1_s4", "q8_n16_m1", "q8_n8_m1", "q8_n8_m1_s2", "q8_n8_m1_s4_p3", "q8_n32_m1"],
            4: ["q8_n16_m4_s4_p3", "q8_n32_m4_p3", "q8_n16_m4_p3", "q8_n8_m4_p3"],
            8: ["q8_n16_m8_p3", "q8_n16_m8_s4_p3", "q8_n32_m8_p3", "q8_n8_m8_p3", "q8_n8_m8_s4_p3"]}
Q8_CHECK = {1: ["q8_n32_m1", "q8_n8_m1_s4", "q8_n8_m1_s4_u2", "q8_n8_m1_s4_p3"],
            4: ["q8_n32_m4", "q8_n16_m4_p3_u2", "q8_n8_m4_p3"],
            8: ["q8_n16_m8", "q8_n16_m8_p3", "q8_n8_m8_p3"],
            3: ["tiny_q8_m4", "q8_n8_m8"]}


def check_q8(log: Log, dev: torch.device, quick: bool) -> bool:
    """Every q8 format vs the float64 twin (the same int8 activation): the activation quantiser bit-exact vs
    its reference, each kernel within the bf16 output rounding, and quant_matmul's default route on CUDA."""
    from ninfer.kernels.gemv_q8 import Q8_FORMATS, gemv_q8, quantize_activation, quantize_activation_reference

    ok = True
    shapes = [(24, 512)] if quick else [(384, 2048), (1040, 5120), (17408, 5120)]
    widths = [1, 3] if quick else [1, 4, 8]
    for fmt in Q8_FORMATS:
        worst, exact = 0.0, True
        for rows, cols in shapes:
            raw = random_gguf_weight(fmt, rows, cols, dev)
            w = dequantize(raw.cpu().reshape(-1), "gguf_" + fmt, (rows, cols)).to(dev).double()
            for width in widths:
                x = torch.randn(width, cols, device=dev, dtype=torch.float32 if quick else torch.bfloat16)
                xa, xr = quantize_activation(x), quantize_activation_reference(x.cpu())
                exact &= all(torch.equal(a.cpu(), b) for a, b in ((xa.q, xr.q), (xa.d, xr.d), (xa.s, xr.s)))
                want = xa.dequantize().to(dev) @ w.t()
                outs = [gemv_q8(raw, fmt, xa, rows, s) for s in Q8_CHECK[width]]
                if dev.type == "cuda":
                    outs.append(quant_matmul(raw, fmt, x, rows))  # the default route: q8 on CUDA
                for out in outs:
                    err = rel_err(out, want) if bool(torch.isfinite(out).all()) else float("inf")
                    worst = max(worst, err)
        passed = worst < 5e-3 and exact  # bf16 output rounding (2^-9)
        ok &= passed
        log(f"check q8 {fmt:5s} worst rel err vs twin {worst:.2e}, quantiser bit-exact {exact} "
            f"{'ok' if passed else 'FAIL'}")
        log.record(kind="check", op="gemv_q8", format=fmt, rel_err=worst, quantiser_exact=exact, ok=passed)
    return ok


def time_q8(log: Log, dev: torch.device, floor: float, formats=("q4_k",)) -> tuple[dict, dict]:
    """Per-shape q8 schedules (CUDA graph over weight copies > L2, one activation: its quantisation is
    done once per graph) at 1, 4, 8 columns beside the wv default route; then the activation quantiser."""
    from ninfer.kernels import gemv_q8

    best_q8: dict = {}
    best_wv: dict = {}
    shapes = sorted(set({**GDN_SHAPES, **ATTN_SHAPES, **MLP_SHAPES}.values()))
    cases = [(fmt, r, c) for fmt in formats for r, c in shapes] + [("q6_k", VOCAB, HIDDEN)]
    for fmt, rows, cols in cases:
        copies = weight_copies(fmt, rows, cols, dev)
        nbytes = copies[0].numel()
        for width in (1, 4, 8):
            x = torch.randn(width, cols, device=dev, dtype=torch.bfloat16)
            times = {}
            for sched in Q8_SWEEP[width]:
                gemv_q8._MEMO.clear()
                times[sched] = graph_us([lambda w=w, s=sched, fmt=fmt, x=x, rows=rows: quant_matmul(
                    w, fmt, x, rows, schedule=s) for w in copies])
            wv = default_schedule(width, fmt, rows, cols).name
            wv_us = graph_us([lambda w=w, s=wv, fmt=fmt, x=x, rows=rows: quant_matmul(
                w, fmt, x, rows, schedule=s) for w in copies])
            sched = min(times, key=times.get)
            us = times[sched]
            best_q8[(fmt, rows, cols, width)] = (sched, us)
            best_wv[(fmt, rows, cols, width)] = (wv, wv_us)
            log(f"q8 gemv {fmt} {rows}x{cols} w{width}: best {sched} {us:.1f} us "
                f"({nbytes / us / 1e6:.2f} TB/s, {100 * nbytes / us / 1e6 / floor:.0f}% of copy) vs wv "
                f"default {wv} {wv_us:.1f} us; " + " ".join(f"{k}={v:.1f}" for k, v in times.items()))
            log.record(kind="time", op="gemv_q8", format=fmt, shape=[rows, cols], width=width, us=times,
                       best=sched, wv_default=wv, wv_us=wv_us, bytes=nbytes)
        del copies
    for cols in (HIDDEN, 6144, FFN):
        for width in (1, 8):
            xs = [torch.randn(width, cols, device=dev, dtype=torch.bfloat16) for _ in range(64)]
            us = graph_us([lambda x=x: gemv_q8.quantize_activation(x) for x in xs])
            log(f"quantize_activation {width}x{cols}: {us:.1f} us")
            log.record(kind="time", op="quantize_activation", shape=[width, cols], us=us)
    return best_q8, best_wv


def sass_q8(log: Log) -> None:
    """SASS instructions per weight in the block loop of each q8 schedule × format (sm_90, no GPU needed);
    per weight of a thread's share of a 256-code step, all columns of the tile together."""
    from sass_tools import compile_sm90, cuobjdump, loop_body, opcode_mix

    from ninfer.kernels import gemv_q8 as q8

    hinted = ("w_ptr", "u_ptr", "xw_ptr", "xd_ptr", "xs_ptr", "y_ptr", "K", "row_bytes", "row_units",
              "stride_ym")
    for fmt in q8.Q8_FORMATS:
        for sc in [s for s in SCHEDULES.values() if s.kernel == "q8" and s.block_m in (1, 8)]:
            const = dict(FMT=q8._FMT[fmt], BLOCK_N=sc.block_n, BLOCK_M=sc.block_m, SPLIT_K=sc.split_k,
                         EMULATE=False, STAGES=sc.num_stages,
                         UNROLL=sc.block_k // 256 if fmt != "q8_0" else 1)
            c = compile_sm90(q8._gemv_q8_kernel, q8_signature(fmt, sc.split_k), const, hinted, sc.num_warps,
                             sc.num_stages)
            body = loop_body(cuobjdump(c, "-sass"))
            if not body:
                log(f"sass q8 {fmt} {sc.name}: no loop found")
                continue
            mix = opcode_mix(body)
            per_thread = sc.block_n * 256 / (32 * sc.num_warps)
            top = " ".join(f"{k} {v}" for k, v in mix.most_common(8))
            log(f"sass q8 {fmt} {sc.name}: {len(body)} instructions per step = {len(body) / per_thread:.2f} "
                f"per weight ({len(body) / per_thread / sc.block_m:.2f} per weight and column); IDP4A "
                f"{mix.get('IDP', 0)}; {top}")


def q8_signature(fmt: str, split_k: int) -> dict:
    unit = "*i64" if fmt in ("q4_k", "q5_k") else "*i32" if fmt == "q6_k" else "*i16"
    return {"w_ptr": "*u8", "u_ptr": unit, "xw_ptr": "*i64", "xd_ptr": "*fp32", "xs_ptr": "*fp32",
            "y_ptr": "*bf16" if split_k == 1 else "*fp32", "N": "i32", "K": "i32", "M": "i32",
            "row_bytes": "i32", "row_units": "i32", "stride_ym": "i32"}


def compile_q8(log: Log) -> bool:
    """Compile the activation quantiser and every q8 schedule × format for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ninfer.kernels import gemv_q8 as q8

    ok = True

    def build(fn, sig, const, name, warps):
        nonlocal ok
        try:
            triton.compile(ASTSource(fn, {**sig, **dict.fromkeys(const, "constexpr")}, const),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
            log(f"compile {name}: ok")
        except Exception as e:  # report every failure, keep going
            ok = False
            log(f"compile {name}: FAILED {type(e).__name__}: {str(e).splitlines()[-1] if str(e) else ''}")

    for dt in ("bf16", "fp16", "fp32"):
        build(q8._quantize_activation_kernel, {"x_ptr": f"*{dt}", "q_ptr": "*i8", "d_ptr": "*fp32",
                                               "s_ptr": "*fp32", "K": "i32", "stride_xm": "i32"},
              {"BLOCKS": 8}, f"quantize_activation {dt}", 4)
    for fmt in q8.Q8_FORMATS:
        for sc in [s for s in SCHEDULES.values() if s.kernel == "q8"]:
            const = dict(FMT=q8._FMT[fmt], BLOCK_N=sc.block_n, BLOCK_M=sc.block_m, SPLIT_K=sc.split_k,
                         EMULATE=False, STAGES=sc.num_stages,
                         UNROLL=sc.block_k // 256 if fmt != "q8_0" else 1)
            build(q8._gemv_q8_kernel, q8_signature(fmt, sc.split_k), const, f"q8 {fmt} {sc.name}",
                  sc.num_warps)
    return ok


def run_q8(log: Log, dev: torch.device, quick: bool, widths: list[int]) -> bool:
    """`--q8` / `--q8-only`: check, per-shape sweep beside the wv default route, decode-step graphs with the
    wv default routes and with the best q8 schedules."""
    ok = check_q8(log, dev, quick)
    log.save()
    if quick or dev.type != "cuda":
        return ok
    floor = copy_bandwidth(log, dev)
    best_q8, best_wv = time_q8(log, dev, floor)
    log.save()
    steps = {}
    for width in widths:
        for name, best in (("wv", best_wv), ("q8", best_q8)):
            steps[(name, width)] = decode_step_graph(log, dev, "q4_k", best, width, torch.float32,
                                                     q8=name == "q8")
            torch.cuda.empty_cache()
    log.save()
    print("\n==== q8 summary ====")
    print(f"checks: {'all passed' if ok else 'FAILURES (see above)'}; copy {floor:.2f} TB/s")
    for key, (sched, us) in sorted(best_q8.items()):
        fmt, rows, cols, width = key
        nbytes = rows * cols // FORMATS[fmt].block_elems * FORMATS[fmt].block_bytes
        wv, wv_us = best_wv[key]
        print(f"gemv {fmt:5s} {rows:6d}x{cols:<6d} w{width}: q8 {us:7.1f} us {nbytes / us / 1e6:5.2f} TB/s "
              f"({100 * nbytes / us / 1e6 / floor:3.0f}% of copy) {sched:14s} | wv default {wv_us:7.1f} us "
              f"{wv}")
    for (name, width), ms in steps.items():
        print(f"decode step q4_k {name} routes w{width}: {ms:.3f} ms -> {1e3 / ms:.0f} steps/s "
              f"({width * 1e3 / ms:.0f} tok/s aggregate)")
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for gpu_check.json")
    ap.add_argument("--quick", action="store_true", help="only the checks, on tiny shapes (CPU works)")
    ap.add_argument("--skip", default="",
                    help="comma list of sections to skip: gemv,defaults,prefill,gdn,graph")
    ap.add_argument("--gemv-formats", default="iq3_s,q4_k",
                    help="formats of the per-shape GEMV sweep (the q6_k head is always timed)")
    ap.add_argument("--graph-widths", default="1,4", help="batch widths of the decode-step graphs")
    ap.add_argument("--check-formats", default=",".join(KERNEL_FORMATS), help="formats the gemm check covers")
    ap.add_argument("--compile-only", action="store_true", help="compile every kernel for sm_90, run nothing")
    ap.add_argument("--sass", action="store_true",
                    help="SASS instructions per weight of the 1-column wv schedules (sm_90, no GPU needed)")
    ap.add_argument("--attention-only", action="store_true",
                    help="only the attention checks and timings (paged decode and prefill)")
    ap.add_argument("--q8", action="store_true", help="also the q8 (int8-activation dp4a GEMV) sections")
    ap.add_argument("--q8-only", action="store_true",
                    help="only the q8 sections: check, sweep beside wv, decode-step graphs (< 3 min, H200)")
    args = ap.parse_args(argv)
    log = Log(args.out)
    if args.sass:
        ok = sass_counts(log)
        sass_q8(log)
        return 0 if ok else 1
    if args.compile_only:
        ok = compile_attention(log) if args.attention_only else compile_all(log) & compile_q8(log)
        log(f"compile {'passed' if ok else 'FAILED'}")
        return 0 if ok else 1
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import triton

    log(f"torch {torch.__version__}, triton {triton.__version__}, device "
        f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, fla {prefill.fla_available()}")
    torch.manual_seed(int(time.time()))  # fresh random inputs every run
    if args.attention_only:
        ok = check_and_time_attention(log, dev, args.quick or dev.type != "cuda")
        log.save()
        log(f"attention {'passed' if ok else 'FAILED'}")
        return 0 if ok else 1
    if args.q8_only:
        ok = run_q8(log, dev, args.quick, [int(w) for w in args.graph_widths.split(",")])
        log.save()
        log(f"q8 {'passed' if ok else 'FAILED'}")
        return 0 if ok else 1
    skip = set(args.skip.split(","))
    ok = check_gemm(log, dev, args.quick, args.check_formats.split(","))
    if args.q8:
        ok &= run_q8(log, dev, args.quick, [int(w) for w in args.graph_widths.split(",")])
    if "gdn" not in skip:
        ok &= check_gdn(log, dev, args.quick)
    log.save()
    if args.quick or dev.type != "cuda":
        log(f"checks {'passed' if ok else 'FAILED'}")
        return 0 if ok else 1
    floor = copy_bandwidth(log, dev)
    formats = tuple(args.gemv_formats.split(","))
    best = time_gemv(log, dev, floor, "defaults" not in skip, formats) if "gemv" not in skip else {}
    log.save()
    if "prefill" not in skip:
        time_prefill_gemm(log, dev)
        log.save()
    gdn = time_gdn(log, dev) if "gdn" not in skip else {}
    log.save()
    steps = {}
    if "graph" not in skip:
        for width in [int(w) for w in args.graph_widths.split(",")]:
            for fmt in ("iq3_s", "q4_k"):
                steps[(fmt, width)] = decode_step_graph(log, dev, fmt, best, width, torch.float32)
                torch.cuda.empty_cache()
        log.save()
    print("\n==== summary ====")
    print(f"checks: {'all passed' if ok else 'FAILURES (see above)'}; copy {floor:.2f} TB/s")
    for (fmt, rows, cols, width), (sched, us) in sorted(best.items()):
        nbytes = rows * cols // FORMATS[fmt].block_elems * FORMATS[fmt].block_bytes
        tbps = nbytes / us / 1e6
        print(f"gemv {fmt:6s} {rows:6d}x{cols:<6d} w{width:<2d} {us:7.1f} us {tbps:5.2f} TB/s "
              f"({100 * tbps / floor:3.0f}% of copy) {sched}")
    for name, us in gdn.items():
        print(f"gdn_decode {name:16s} {us:6.1f} us/layer")
    for (fmt, width), ms in steps.items():
        print(f"decode step {fmt} w{width}: {ms:.3f} ms -> {1e3 / ms:.0f} steps/s "
              f"({width * 1e3 / ms:.0f} tok/s aggregate)")
    log.save()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
