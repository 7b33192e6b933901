"""GPU check and timing of the coalesced-rows int8-activation GEMVs (ninfer/kernels/gemv_rows.py: q4_k, q5_k;
gemv_rows_iq.py: iq3_s, iq4_xs; gemv_rows_q6k.py: q6_k at one column) and the int8 tensor-core GEMM
(gemv_mma.py: q4_k, q5_k, q6_k, iq3_s at 2–16 columns) beside the q8 routes they replace (gemv_q8.py,
gemv_q8_iq.py).

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
    PYTHONUNBUFFERED=1 python3 bench/rows_timing.py --out $OUT [--budget 150]
    python3 bench/rows_timing.py --out $OUT --only mma --widths 2,4,8,16   # the tensor-core tiles alone
    python bench/rows_timing.py --quick        # CPU: the checks on a tiny shape through Triton's interpreter

Check: every schedule vs the float64 twin (the same int8 activation) on fresh random GGUF rows, 1040×5120 and
17408×5120 (20 blocks per row: whole and partly masked steps), 1/3/8 columns. Timing: per 27B shape and
width (1, 2, 4, 8; 16 on request), each schedule serving that width (a tensor-core tile serves 2 up to its
own) inside one CUDA graph whose calls rotate over weight copies larger than 3× the L2
(`gpu_check.graph_us`; the activation quantised once, outside the graph), and the q8 route (two 1-column
calls at 2 columns, as quant_matmul runs it; the default route above 8). Prints a table last.
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
from ninfer.kernels import gemv_frag as frag_mod  # noqa: E402
from ninfer.kernels import gemv_mma as mma_mod  # noqa: E402
from ninfer.kernels import gemv_rows as rows_mod  # noqa: E402
from ninfer.kernels import gemv_rows_iq as iq_mod  # noqa: E402
from ninfer.kernels import gemv_rows_q6k as q6k_mod  # noqa: E402
from ninfer.kernels.gemv_q8 import gemv_q8, quantize_activation  # noqa: E402
from ninfer.kernels.gemv_q8_iq import gemv_q8_iq  # noqa: E402
from ninfer.kernels.gguf_matmul import default_schedule, quant_matmul  # noqa: E402

SHAPES = [(17408, 5120), (5120, 17408), (10240, 5120), (12288, 5120), (6144, 5120), (1024, 5120), (48, 5120)]
CHECK_SHAPES = [(1040, 5120), (17408, 5120)]
WIDTHS = (1, 2, 4, 8)


NVRTC = False  # --nvrtc: also the CUDA C iq3_s experiment (bench/nvrtc_iq3s.py)


def kernel(fmt: str):
    """(schedules, GEMV, route) for a format: the rows kernel's schedules (gemv_rows_iq for the i-quants), the
    tensor-core ones where gemv_mma and gemv_frag take the format (and the NVRTC experiment's under --nvrtc),
    and quant_matmul's route."""
    iq = fmt in iq_mod.IQ_ROWS_FORMATS
    rows_gemv = iq_mod.gemv_rows_iq if iq else q6k_mod.gemv_rows_q6k if fmt == "q6_k" else rows_mod.gemv_rows
    mma = mma_mod.schedules_for(fmt)
    frag = frag_mod.schedules_for(fmt)
    cuda = {}
    if NVRTC and fmt == "iq3_s":
        from bench import nvrtc_iq3s, nvrtc_iq3s_il

        cuda = {**nvrtc_iq3s.SCHEDULES, **nvrtc_iq3s_il.SCHEDULES}

    # iq3_s: the rows schedules on the 112-byte aligned blocks too ("_pad"; repacked on the first call,
    # outside the timed graph, and kept on the weight tensor)
    pad = {f"{n}_pad": s for n, s in iq_mod.SCHEDULES.items() if not s.signed_grid} if fmt == "iq3_s" else {}

    def gemv(raw, fmt, xa, rows, name):
        if name in cuda:
            if name in nvrtc_iq3s_il.SCHEDULES:
                return nvrtc_iq3s_il.gemv_cuda_iq3s_il(raw, xa, rows, name)
            return nvrtc_iq3s.gemv_cuda_iq3s(raw, xa, rows, name)
        if name in pad:
            if not hasattr(raw, "padded_copy"):
                raw.padded_copy = iq_mod.iq3_s_padded(raw)
            return iq_mod.gemv_rows_iq(raw.padded_copy, fmt, xa, rows, name.removesuffix("_pad"), padded=True)
        if name in frag:
            return frag_mod.gemv_frag(raw, fmt, xa, rows, name)
        return (mma_mod.gemv_mma if name in mma else rows_gemv)(raw, fmt, xa, rows, name)

    rows_route = (iq_mod.rows_iq_route if iq else q6k_mod.rows_q6k_route if fmt == "q6_k"
                  else rows_mod.rows_route)

    def route(fmt, rows, cols, width):
        """The schedule quant_matmul takes (its order: the q6_k head's rows kernel, fragment kernel,
        tensor-core tile, rows kernel)."""
        head = rows_route(fmt, rows, cols, width) if fmt == "q6_k" else None
        return (head or frag_mod.frag_route(fmt, rows, cols, width)
                or mma_mod.mma_route(fmt, rows, cols, width) or rows_route(fmt, rows, cols, width))

    rows = (iq_mod.SCHEDULES if iq else q6k_mod.SCHEDULES if fmt == "q6_k"
            else rows_mod.SCHEDULES if fmt in rows_mod.ROWS_FORMATS else {})
    return {**rows, **pad, **mma, **frag, **cuda}, gemv, route


def serves(s, width: int) -> bool:
    """A rows tile serves its own width, a tensor-core tile every width from 2 to its own, a fragment tile
    of 8 columns 1-8 and one of 16 columns 9-16."""
    if s.kernel in ("cuda", "il", "il_mma"):  # 1-8 columns
        return width <= 8
    if s.kernel == "frag":
        return width <= s.block_m and (width > 8) == (s.block_m > 8)
    return s.block_m == width or (s.kernel == "mma" and 2 <= width <= s.block_m)


def sweep(fmt: str, width: int, only: str = "") -> list[str]:
    """The schedules for `width` columns whose names contain one of the comma-separated `only` parts (a part
    ending in `$`: the whole name)."""
    parts = [p for p in only.split(",") if p]
    return [name for name, s in kernel(fmt)[0].items()
            if serves(s, width) and (not parts or any(p in name if p[-1] != "$" else p[:-1] == name
                                                      for p in parts))]


def best_of(times: dict) -> str:
    return min(times, key=times.get)


def q8_call(raw, fmt: str, xa, x, rows: int, cols: int):
    """The q8 route as quant_matmul runs it (2 columns: two 1-column GEMVs; above 8 the default route)."""
    width = xa.q.shape[0]
    if width > 8:
        return lambda: quant_matmul(raw, fmt, x, rows)
    if fmt in iq_mod.IQ_ROWS_FORMATS:
        return lambda: gemv_q8_iq(raw, fmt, xa, rows, None)
    one = default_schedule(1, fmt, rows, cols, q8=True)
    if width == 2:
        return lambda: [gemv_q8(raw, fmt, xa.row(i), rows, one) for i in range(2)]
    s = default_schedule(width, fmt, rows, cols, q8=True)
    return lambda: gemv_q8(raw, fmt, xa, rows, s)


def checked(fmt: str, width: int, only: str) -> list[str]:
    """The schedules checked at `width` columns: every one serving that width or more."""
    return list(dict.fromkeys(n for w in WIDTHS if w >= width for n in sweep(fmt, w, only)))


def check(log: Log, dev: torch.device, quick: bool, formats: list[str], only: str = "") -> bool:
    """Every schedule (or those `only` names) vs the float64 twin."""
    return check_gemvs(log, dev, "rows", formats, [(24, 1280)] if quick else CHECK_SHAPES,
                       (1, 3) if quick else (1, 3, 8),
                       lambda fmt, width: checked(fmt, width, only)[:2 if quick else None],
                       lambda raw, fmt, xa, rows, name: kernel(fmt)[1](raw, fmt, xa, rows, name))


def time_all(log: Log, dev: torch.device, formats: list[str], floor: float, budget: float, t0: float,
             widths=WIDTHS, only: str = "", shapes=SHAPES) -> list:
    table = []
    for rows, cols in shapes:
        for fmt in formats:
            if time.time() - t0 > budget:
                log(f"budget of {budget:.0f} s spent: {fmt} {rows}x{cols} and later shapes not timed")
                return table
            copies = weight_copies(fmt, rows, cols, dev, at_least=3)
            nbytes, n_copies = copies[0].numel(), len(copies)
            for width in widths:
                x = torch.randn(width, cols, device=dev, dtype=torch.bfloat16)
                xa = quantize_activation(x)
                _, gemv, route_of = kernel(fmt)
                route = route_of(fmt, rows, cols, width)
                names = dict.fromkeys(sweep(fmt, width, only) + ([route.name] if route else []))
                if not names:
                    log(f"{fmt} {rows}x{cols} w{width}: no schedule serves this width")
                    continue
                times = {name: graph_us([lambda w=w, n=name, f=fmt, x=xa, r=rows, k=gemv: k(w, f, x, r, n)
                                         for w in copies]) for name in names}
                q8_us = graph_us([q8_call(w, fmt, xa, x, rows, cols) for w in copies])
                route = route.name if route else best_of(times)
                best = best_of(times)
                us = times[best]
                tbps = nbytes / us / 1e6
                log(f"{fmt} {rows}x{cols} w{width}: best {best} {us:.1f} us ({tbps:.2f} TB/s, "
                    f"{100 * tbps / floor:.0f}% of copy); route {route} {times[route]:.1f}; q8 {q8_us:.1f}; "
                    + " ".join(f"{k}={v:.1f}" for k, v in times.items()))
                log.record(kind="time", format=fmt, shape=[rows, cols], width=width, us=times, best=best,
                           q8_us=q8_us, bytes=nbytes, copies=n_copies)
                table.append((fmt, rows, cols, width, best, us, tbps, times[route], route, q8_us))
            log.save()
            del copies
            torch.cuda.empty_cache()
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for rows_timing.json")
    ap.add_argument("--quick", action="store_true", help="only the checks on a tiny shape (CPU works)")
    ap.add_argument("--formats", default="q4_k,q5_k", help="formats to check (\"\": none)")
    ap.add_argument("--time-formats", default="q4_k", help="formats to time")
    ap.add_argument("--widths", default="1,2,4,8", help="column counts to time (up to 16)")
    ap.add_argument("--only", default="", help="comma-separated parts of schedule names to check and time "
                    "(NAME$: exactly NAME)")
    ap.add_argument("--shapes", default="", help="rows x columns to time, e.g. 248320x5120,17408x5120 "
                    "(default: the 27B layer shapes; 248320x5120 is the output head)")
    ap.add_argument("--budget", type=float, default=150.0, help="stop timing new shapes after this many s")
    ap.add_argument("--nvrtc", action="store_true",
                    help="also the CUDA C iq3_s experiments (bench/nvrtc_iq3s.py, nvrtc_iq3s_il.py)")
    a = ap.parse_args(argv)
    global NVRTC
    NVRTC = a.nvrtc and torch.cuda.is_available()
    t0 = time.time()
    log, dev = timing_session(a.out, "rows_timing.json")
    formats = [f for f in a.formats.split(",") if f]  # "" times without checking
    ok = check(log, dev, a.quick or dev.type != "cuda", formats, a.only)
    log.save()
    if a.quick or dev.type != "cuda":
        log(f"checks {'passed' if ok else 'FAILED'}")
        return 0 if ok else 1
    floor = copy_bandwidth(log, dev)
    shapes = [tuple(int(v) for v in p.split("x")) for p in a.shapes.split(",") if p] or SHAPES
    table = time_all(log, dev, a.time_formats.split(","), floor, a.budget, t0,
                     [int(w) for w in a.widths.split(",")], a.only, shapes)
    log.save()
    print(f"\n==== rows GEMV (checks {'passed' if ok else 'FAILED'}; copy {floor:.2f} TB/s) ====")
    print("| format | shape | cols | best schedule | µs | TB/s | % copy | route µs (sched) | q8 route µs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for fmt, rows, cols, width, best, us, tbps, r_us, route, q8_us in table:
        print(f"| {fmt} | {rows}×{cols} | {width} | {best} | {us:.1f} | {tbps:.2f} | "
              f"{100 * tbps / floor:.0f} | {r_us:.1f} ({route}) | {q8_us:.1f} |")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
