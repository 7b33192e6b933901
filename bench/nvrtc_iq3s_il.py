"""The lane-per-row iq3_s GEMV's schedule sweep (session 26; the kernel and its layout live in
`ninfer/kernels/gemv_il.py`): `rows_timing.py --nvrtc` times every schedule here beside the routes on the GGUF
layout, each weight repacked on its first call (outside the timed graph) and kept as `raw.il32`.

    python3 bench/rows_timing.py --out $OUT --nvrtc --formats iq3_s --time-formats iq3_s --only cu_il \
        --widths 1,2,4,8 --shapes 34816x5120,5120x17408,16480x5120,14336x5120,5120x6144

H200, session 26 run 2, µs (best il schedule / the GGUF layout's route): 1 column 34816×5120 32.9 / 44.2,
16480×5120 17.2 / 22.3, 14336×5120 16.8 / 20.2, 5120×17408 22.9 / 26.7, 5120×6144 10.7 / 10.6; 2 columns
40.3 / 52.9, 20.9 / 27.6, 20.2 / 24.0, 29.7 / 28.0; 8 columns 88.5 / 79.6, 41.1 / 40.8, 40.7 / 36.3,
62.2 / 48.2 (gpu-notes "Session 26"). Session 28 run 4, the routed `cu_il_w10_c16` (activation staged in
shared memory) at 1 column: 30.9, 15.8, 22.6 (down); `cu_il_w10_c16_nt` at 2: 34.6, 18.3, 27.3. Session 29
run 2 (both kernels as programmatic dependent launches, which the timed graph's back-to-back calls overlap),
1 / 2 columns (`_nt` at 2): 30.7 / 34.6, 15.4 / 17.8, 22.0 / 27.2, 14.6 / 17.1 (14336×5120), 5120×6144 9.0 /
10.2 without `_nt` (11.2 with it; the rows route 10.7 / 11.4). Since session 33 both kernels sign a grid word
by xor 0xFE from the plain table, and the `_nt` ({word, negated word}) schedules are gone.
"""

from __future__ import annotations

import torch

from ninfer.kernels.gemv_il import IlSchedule, gemv_il, repack_il32
from ninfer.kernels.gemv_q8 import QuantizedActivation
from ninfer.kernels.gguf_matmul import check_weight

_TILES = ((32, (10, 17)), (16, (5, 6, 10, 12, 17)), (8, (5, 10, 17)))  # (copies, warps)
_MMA = ((4, 128), (5, 128), (10, 96), (10, 128), (20, 96))  # (warps, registers) of the tensor-core kernel
SCHEDULES = {"cu_" + s.name: s for s in (
    [IlSchedule(w, c) for c, ws in _TILES for w in ws]
    + [IlSchedule(w, kernel="il_mma", regs=r) for w, r in _MMA])}


def gemv_cuda_iq3s_il(raw: torch.Tensor, xa: QuantizedActivation, out_features: int, name: str
                      ) -> torch.Tensor:
    """`gemv_il` on the GGUF rows `raw` (uint8, CUDA), repacked on the first call."""
    check_weight(raw, "iq3_s", out_features, xa.q.shape[1])
    if not hasattr(raw, "il32"):
        raw.il32 = repack_il32(raw)
    return gemv_il(raw.il32, xa, out_features, SCHEDULES[name])
