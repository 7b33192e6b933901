"""GPU check and timing of the tensor-core fragment GEMVs: the int8 kernel (ninfer/kernels/gemv_frag.py, int8
activation) and the bf16 experiment (bench/frag_bf16.py: q4_k decoded to bf16 in registers, the bf16
activation as it is), beside the decode route `quant_matmul` takes.

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
    PYTHONUNBUFFERED=1 python3 bench/frag_timing.py --out $OUT --only frag_w2_r1_m8,frag_w4_r1_m8_s2
    python bench/frag_timing.py --quick        # CPU: the checks on a tiny shape through Triton's interpreter

Check: every schedule named by --only vs its float64 twin on fresh random q4_k rows (bf16:
`gemv_frag_bf16_twin`, int8: `gemv_q8_reference`), 1/3/8/16 columns. Timing: per shape and width, each
schedule (kernel "int8", "bf16" or "bf16np": no prefetch) inside one CUDA graph over weight copies larger than
3× the L2 (`gpu_check.graph_us`), and the route. Prints a table last.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("NINFER_TRITON_ON_CPU", "1")  # --quick on CPU runs the kernels in the interpreter

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.frag_bf16 import gemv_frag_bf16, gemv_frag_bf16_twin  # noqa: E402
from bench.gpu_check import Log, graph_us, timing_session, weight_copies  # noqa: E402
from ninfer.kernels import gemv_frag as frag  # noqa: E402
from ninfer.kernels.gemv_q8 import gemv_q8_reference, quantize_activation  # noqa: E402
from ninfer.kernels.gguf_matmul import quant_matmul, random_gguf_weight  # noqa: E402

SHAPES = [(17408, 5120), (5120, 17408), (10240, 5120), (6144, 5120), (1024, 5120)]


def run(kind: str, raw, x, xa, rows: int, name: str):
    """One call of kernel `kind`: "bf16" (loads one step ahead), "bf16np" (no prefetch) or "int8"."""
    if kind.startswith("bf16"):
        return gemv_frag_bf16(raw, "q4_k", x, rows, name, prefetch=kind == "bf16")
    return frag.gemv_frag(raw, "q4_k", xa, rows, name)


def check(log: Log, dev: torch.device, names: list[str], quick: bool) -> bool:
    ok = True
    rows, cols = (40, 512) if quick else (1040, 5120)
    for width in (1, 3) if quick else (1, 3, 8, 16):
        raw = random_gguf_weight("q4_k", rows, cols, dev)
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        x = torch.randn(width, cols, device=dev, dtype=dtype)
        xa = quantize_activation(x)
        for name in names:
            if not frag.SCHEDULES[name].block_m >= width:
                continue
            for kind in ("bf16", "bf16np", "int8"):
                y = run(kind, raw, x, xa, rows, name).double().cpu()
                want = (gemv_frag_bf16_twin(raw, x, rows) if kind.startswith("bf16")
                        else gemv_q8_reference(raw, "q4_k", xa, rows)).cpu()
                # of max|y|: fp32 sums of exact products (≤ 2.3e-7 measured on CPU); bf16 output on the GPU
                err = float((y - want).abs().max() / want.abs().max())
                good = err <= (4e-3 if dev.type == "cuda" else 1e-6)
                ok &= good
                if not good or quick:
                    log(f"check {kind} {name} w{width}: rel err {err:.2e} {'ok' if good else 'FAILED'}")
    log(f"checks {'passed' if ok else 'FAILED'}")
    return ok


def time_all(log: Log, dev: torch.device, names: list[str], widths: list[int], kinds: list[str],
             shapes=SHAPES) -> list:
    table = []
    for rows, cols in shapes:
        copies = weight_copies("q4_k", rows, cols, dev, at_least=3)
        for width in widths:
            x = torch.randn(width, cols, device=dev, dtype=torch.bfloat16)
            xa = quantize_activation(x)
            times = {}
            for kind in kinds:
                for name in names:
                    s = frag.SCHEDULES[name]
                    if s.block_m < width or (width <= 8 < s.block_m):
                        continue
                    times[f"{kind}:{name}"] = graph_us([lambda w=w, k=kind, n=name, x=x, xa=xa, r=rows:
                                                        run(k, w, x, xa, r, n) for w in copies])
            route = graph_us([lambda w=w, x=x, r=rows: quant_matmul(w, "q4_k", x, r) for w in copies])
            best = min(times, key=times.get)
            log(f"q4_k {rows}x{cols} w{width}: best {best} {times[best]:.1f} us; route {route:.1f}; "
                + " ".join(f"{k}={v:.1f}" for k, v in sorted(times.items(), key=lambda kv: kv[1])))
            log.record(kind="time", shape=[rows, cols], width=width, us=times, route_us=route)
            table.append((rows, cols, width, best, times[best], route))
        log.save()
        del copies
        torch.cuda.empty_cache()
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for frag_timing.json")
    ap.add_argument("--quick", action="store_true", help="only the checks on a tiny shape (CPU works)")
    ap.add_argument("--only", default="frag_w2_r1_m8,frag_w2_r1_m8_s2",
                    help="comma-separated schedule names (gemv_frag.SCHEDULES)")
    ap.add_argument("--kinds", default="bf16,int8", help="kernels to time: bf16, bf16np, int8")
    ap.add_argument("--widths", default="1,2,4,8", help="column counts to time (up to 16)")
    ap.add_argument("--shapes", default="", help="rows x columns to time, e.g. 12288x5120 (default: SHAPES)")
    a = ap.parse_args(argv)
    log, dev = timing_session(a.out, "frag_timing.json")
    names = a.only.split(",")
    ok = check(log, dev, names[:1] if a.quick else names, a.quick or dev.type != "cuda")
    log.save()
    if a.quick or dev.type != "cuda":
        return 0 if ok else 1
    shapes = [tuple(int(v) for v in p.split("x")) for p in a.shapes.split(",") if p] or SHAPES
    table = time_all(log, dev, names, [int(w) for w in a.widths.split(",")], a.kinds.split(","), shapes)
    log.save()
    print(f"\n==== fragment GEMVs, q4_k (checks {'passed' if ok else 'FAILED'}) ====")
    print("| shape | cols | best | µs | route µs |\n|---|---|---|---|---|")
    for rows, cols, width, best, us, route in table:
        print(f"| {rows}×{cols} | {width} | {best} | {us:.1f} | {route:.1f} |")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
