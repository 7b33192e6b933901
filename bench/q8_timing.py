"""GPU check and timing of the q8 (int8-activation, dp4a) i-quant GEMV (ninfer/kernels/gemv_q8_iq.py).

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
    PYTHONUNBUFFERED=1 python3 bench/q8_timing.py --out $OUT [--budget 170] [--formats iq3_s,iq4_xs]
    python bench/q8_timing.py --quick        # CPU: the checks on a tiny shape through Triton's interpreter

Check: every swept schedule vs the float64 twin (the same int8 activation) on fresh random GGUF rows,
1040×5120 and 17408×5120, 1/4/8 columns. Timing: per 27B shape and width, each schedule inside one CUDA graph
whose calls rotate over ≥ 3 weight copies larger than the 60 MB L2 (`gpu_check.graph_us`; the activation
is quantised once, outside the graph), beside the word-vector ("wv") route of `quant_matmul` for the same
shape. Prints a compact table last (best schedule, µs, TB/s, % of copy, wv µs); logs go to --out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("NINFER_TRITON_ON_CPU", "1")  # --quick on CPU runs the kernels in the interpreter

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_check import Log, check_gemvs, copy_bandwidth, graph_us, timing_session, weight_copies  # noqa: E402
from ninfer.kernels.gemv_q8 import quantize_activation  # noqa: E402
from ninfer.kernels.gemv_q8_iq import default_iq_schedule, gemv_q8_iq  # noqa: E402
from ninfer.kernels.gguf_matmul import default_schedule, quant_matmul  # noqa: E402

SHAPES = [(17408, 5120), (5120, 17408), (10240, 5120), (12288, 5120), (6144, 5120), (1024, 5120), (48, 5120)]
CHECK_SHAPES = [(1040, 5120), (17408, 5120)]
WIDTHS = (1, 4, 8)
SWEEP = {
    1: ["q8_n16_m1_s4", "q8_n8_m1_s4_w2", "q8_n16_m1_p1", "q8_n16_m1_p2", "q8_n16_m1_p2_d2",
        "q8_n16_m1_s4_p2_d2", "q8_n8_m1_s4_w2_p2", "q8_n8_m1_s4_w2_p2_d2", "q8_n16_m1_p2_l1",
        "q8_n8_m1_s4_w2_p2_d2_l1", "q8_n16_m1_k", "q8_n16_m1_k_l1", "q8_n16_m1_k_p2", "q8_n16_m1_k_p2_l1",
        "q8_n8_m1_k_w2_p2", "q8_n4_m1_b4", "q8_n4_m1_b4_p2", "q8_n4_m1_b4_s2_p2", "q8_n8_m1_b2_p2"],
    4: ["q8_n16_m4", "q8_n16_m4_s4", "q8_n32_m4_p2", "q8_n16_m4_s4_p2", "q8_n16_m4_s4_p2_d2",
        "q8_n16_m4_s4_p2_d2_l1", "q8_n16_m4_k", "q8_n16_m4_k_l1", "q8_n16_m4_k_p2_l1"],
    8: ["q8_n16_m8_p1", "q8_n16_m8_s4_p1", "q8_n32_m8_w4", "q8_n16_m8_s4_p1_d2", "q8_n16_m8_s4_p1_d2_l1",
        "q8_n16_m8_k", "q8_n16_m8_k_l1", "q8_n16_m8_k_p1_l1"],
}


def check(log: Log, dev: torch.device, quick: bool, formats: list[str]) -> bool:
    """Every swept schedule and the default one vs the float64 twin."""
    return check_gemvs(log, dev, "q8 iq", formats, [(24, 512)] if quick else CHECK_SHAPES,
                       (1, 3) if quick else WIDTHS,
                       lambda fmt, width: SWEEP[min(w for w in WIDTHS if w >= width)][:2 if quick else None]
                       + [None], gemv_q8_iq)


def _time_q8(copies: list, fmt: str, xa, rows: int, name: str) -> float:
    return graph_us([lambda w=w: gemv_q8_iq(w, fmt, xa, rows, name) for w in copies])


def time_all(log: Log, dev: torch.device, formats: list[str], floor: float, budget: float, t0: float) -> list:
    rows_out = []
    for rows, cols in SHAPES:
        for fmt in formats:
            if time.time() - t0 > budget:
                log(f"budget of {budget:.0f} s spent: {fmt} {rows}x{cols} and later shapes not timed")
                return rows_out
            copies = weight_copies(fmt, rows, cols, dev, at_least=3)
            nbytes, n_copies = copies[0].numel(), len(copies)
            for width in WIDTHS:
                x = torch.randn(width, cols, device=dev, dtype=torch.bfloat16)
                xa = quantize_activation(x)
                dflt = default_iq_schedule(fmt, rows, cols, width).name
                times = {name: _time_q8(copies, fmt, xa, rows, name)
                         for name in dict.fromkeys(SWEEP[width] + [dflt])}
                wv = default_schedule(width, fmt, rows, cols).name
                wv_us = graph_us([lambda w=w, f=fmt, x=x, n=rows, s=wv: quant_matmul(w, f, x, n, schedule=s)
                                  for w in copies])
                best = min(times, key=times.get)
                us = times[best]
                tbps = nbytes / us / 1e6
                log(f"{fmt} {rows}x{cols} w{width}: best {best} {us:.1f} us ({tbps:.2f} TB/s, "
                    f"{100 * tbps / floor:.0f}% of copy); default {dflt} {times[dflt]:.1f}; "
                    f"wv {wv} {wv_us:.1f}; "
                    + " ".join(f"{k}={v:.1f}" for k, v in times.items()))
                log.record(kind="time", format=fmt, shape=[rows, cols], width=width, us=times, best=best,
                           wv=wv, wv_us=wv_us, bytes=nbytes, copies=n_copies)
                rows_out.append((fmt, rows, cols, width, best, us, tbps, times[dflt], dflt, wv_us, wv))
            log.save()
            del copies
            torch.cuda.empty_cache()
    return rows_out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for q8_timing.json")
    ap.add_argument("--quick", action="store_true", help="only the checks on a tiny shape (CPU works)")
    ap.add_argument("--formats", default="iq3_s,iq4_xs")
    ap.add_argument("--budget", type=float, default=170.0, help="stop timing new shapes after this many s")
    ap.add_argument("--no-check", action="store_true")
    a = ap.parse_args(argv)
    t0 = time.time()
    log, dev = timing_session(a.out, "q8_timing.json")
    formats = a.formats.split(",")
    ok = True if a.no_check else check(log, dev, a.quick or dev.type != "cuda", formats)
    log.save()
    if a.quick or dev.type != "cuda":
        log(f"checks {'passed' if ok else 'FAILED'}")
        return 0 if ok else 1
    floor = copy_bandwidth(log, dev)
    table = time_all(log, dev, formats, floor, a.budget, t0)
    log.save()
    print(f"\n==== q8 i-quant GEMV (checks {'passed' if ok else 'FAILED'}; copy {floor:.2f} TB/s) ====")
    print("| format | shape | cols | best schedule | µs | TB/s | % copy | default µs (sched) "
          "| wv µs (sched) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for fmt, rows, cols, width, best, us, tbps, d_us, dflt, wv_us, wv in table:
        print(f"| {fmt} | {rows}×{cols} | {width} | {best} | {us:.1f} | {tbps:.2f} | "
              f"{100 * tbps / floor:.0f} | {d_us:.1f} ({dflt}) | {wv_us:.1f} ({wv}) |")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
