"""q6_k decode GEMV on int8 tensor cores over a lane-per-row repack ("q6il"), CUDA C compiled by NVRTC — the
output heads (248,320 × 5,120 at the 27B) at 1-16 columns (`q6il_wanted`, `q6il_matmul`; `Linear`'s layout
"q6il").

The q6_k head cost 277 µs at one column on the rows kernel (3.77 TB/s) but 448 at four and 503 at eight: its
GGUF-layout kernels decode the weights again for every column or run at a low occupancy. Here each weight is
decoded once into an `mma.m16n8k16` fragment and every column is one operand of the same instruction, as
`gemv_il.iq3s_il_mma` does for iq3_s; q6_k's decode is cheap (no table). H200 (session 34,
`bench/head_timing.py --q6il`): 280 / 267 / 285 / 317 µs at 1 / 2 / 4 / 8 columns (3.72 / 3.90 / 3.66 / 3.29
TB/s); the 4-column step 7.95 → 7.79 ms, IQ3_S C = 8 872 → 903 tok/s. On a Q4_K_M file's 5120×17408 down
projections it loses at one column (31.8 against the rows kernel's 28.8 µs) and wins at 4 and 8 (37.4 / 45.3
against 46.3 / 53.5): those stay in the GGUF layout (`HEAD_ROWS`), one copy of the weight serving every width.

Layout (`repack_q6il`, lossless, the same size): per row and pair of 210-byte blocks, 105 words — block 0's
ql (32 words), qh (16), scales (4), then block 1's, then both d in one word; word j of pair p of the rows of
32-row tile t at `((t·P + p)·105 + j)·32 + r`. Lane 4g + t of a warp owns rows 4g..4g + 3 (one 16-byte load
of a word serves all four) and, within each 16-input step, inputs 4t..4t + 3: the four lanes of a group load
four different words, so every byte a warp loads is used.

A 16-input step (n, q, s) of a block (n: half, q: quarter of the half, s: which 16 of the quarter's 32;
inputs 128n + 32q + 16s + 0..15; its scale `scales[8n + 2q + s]`): lane t's word of row r is the unsigned
6-bit values `(ql & 0x0F0F0F0F) | (qh bits << 4)` of ql word 16n + 8(q & 1) + 4s + t (low nibbles for q < 2,
high for q ≥ 2) and qh word 32 + 8n + 4s + t (bits 2q, 2q + 1 of each byte). `mma.m16n8k16.u8.s8` multiplies
them with the activation; the accumulator starts at −32 × the step's activation sum (each CTA sums the
activation per 16 inputs into shared memory first), so the result is Σ (q − 32)·x exactly; times the step's
int8 scale (a sign-extending `prmt`) into an integer sum a block; one float conversion a block (the
activation per 256 inputs, `quantize_activation(group=256)`).
"""

from __future__ import annotations

import functools
import os

import torch

from ninfer.kernels.gemv_il import (
    _OUT_KINDS,
    CUDA_HELPERS,
    _launch,
    _smem_optin,
    check_call,
    evict_level,
    next_prefetch,
    with_prefetch,
)
from ninfer.kernels.gemv_q8 import QuantizedActivation, gemv_q8_reference
from ninfer.kernels.lane_layout import TILE_STORE, LaneLayout, builds
from ninfer.kernels.triton_support import pdl_enabled

LAYOUT = LaneLayout("q6_k", 210, body=((0, 208),), tail=(208, 210))  # ql, qh, scales; then d
PAIR_WORDS = LAYOUT.words  # 105
MAX_COLUMNS = 8
WARPS = 10
HEAD_ROWS = 32768  # q6il_wanted: the output heads (248,320 rows at the 27B)


def q6il_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """(32-row tiles, block pairs) of the layout."""
    return LAYOUT.shape(out_features, in_features)


def repack_q6il(raw: torch.Tensor, chunk_rows: int = 8192) -> torch.Tensor:
    """q6_k rows `raw` (uint8 `[N, nblk·210]`) as the int32 words of the layout (module doc),
    `[tiles · pairs · 105 · 32]`, on raw's device (`LaneLayout.repack`)."""
    return LAYOUT.repack(raw, chunk_rows)


def unpack_q6il(words: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The GGUF rows `[out_features, in_features/256 · 210]` back from `repack_q6il`'s words."""
    return LAYOUT.unpack(words, out_features, in_features)


def check_q6il(words: torch.Tensor, out_features: int, in_features: int) -> None:
    LAYOUT.check(words, out_features, in_features, "q6il")


_SOURCE = r"""
#define OUT_KIND __OUT_KIND__
#define NCOL __NCOL__
#define WARPS __WARPS__
#define PDL __PDL__
#define EVICT __EVICT__
""" + CUDA_HELPERS + TILE_STORE + r"""
__device__ __forceinline__ unsigned part(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
// d += a (16 rows × 16 unsigned bytes) · b (16 signed bytes × 8 columns), int32
__device__ __forceinline__ void mma_u8s8(int (&c)[4], unsigned a0, unsigned a1, int b0) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3]) : "r"(a0), "r"(a1), "r"(b0));
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, 2)
q6k_il_mma(const uint4* __restrict__ w, const int* __restrict__ xw, const float* __restrict__ xd,
           out_t* __restrict__ y, int N, int K, int stride_y NEXT_PARAMS)
{
    extern __shared__ int smem[];
    const int K4 = K >> 2, K16 = K >> 4, nblk = K >> 8, P = (K + 511) >> 9, tiles = (N + 31) >> 5;
    int* xs = smem;  // −32 × the activation's sum over each 16 inputs [K16][8 columns]
    float* red = reinterpret_cast<float*>(xs + K16 * 8);  // [WARPS][32 rows][8 columns] partial sums
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");  // the activation is the previous kernel's output
#endif
    for (int i = threadIdx.x; i < K16 * 8; i += WARPS * 32) {
        const int m = min(i & 7, NCOL - 1);  // columns past the last: the last (never stored)
        const int4 v = reinterpret_cast<const int4*>(xw + m * K4)[i >> 3];
        int s = dp4a(0x01010101u, v.x, 0);
        s = dp4a(0x01010101u, v.y, s);
        s = dp4a(0x01010101u, v.z, s);
        xs[i] = -32 * dp4a(0x01010101u, v.w, s);
    }
    __syncthreads();
    const unsigned lane = threadIdx.x & 31, wid = threadIdx.x >> 5, gq = lane >> 2, t = lane & 3;
    const int* xl = xw + min((int)gq, NCOL - 1) * K4 + t;  // B word of step i at xl[4 i]
    const int2* xsl = reinterpret_cast<const int2*>(xs) + t;  // −32·sums, columns 2t, 2t + 1; step i at [4 i]
    const float* xd0 = xd + min(2 * (int)t, NCOL - 1) * nblk;
    const float* xd1 = xd + min(2 * (int)t + 1, NCOL - 1) * nblk;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        float acc[4][2];
#pragma unroll
        for (int r = 0; r < 4; ++r) { acc[r][0] = 0.f; acc[r][1] = 0.f; }
        for (int kb = wid; kb < nblk; kb += WARPS) {
            const uint4* wb = w + (size_t)(tile * P + (kb >> 1)) * (105 * 8) + gq;  // word j at wb[8 j]
            const uint4* blk = wb + 8 * 52 * (kb & 1);
            const uint4 dd = ldw4(wb + 8 * 104);
            int isum[4][2] = {{0, 0}, {0, 0}, {0, 0}, {0, 0}};
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                // scales 8n, 8n + 4..
                const uint4 sc0 = ldw4(blk + 8 * (48 + 2 * n)), sc1 = ldw4(blk + 8 * (49 + 2 * n));
#pragma unroll
                for (int s = 0; s < 2; ++s) {
                    const uint4 qa = ldw4(blk + 8 * (16 * n + 4 * s + t));
                    const uint4 qb = ldw4(blk + 8 * (16 * n + 8 + 4 * s + t));
                    const uint4 qh = ldw4(blk + 8 * (32 + 8 * n + 4 * s + t));
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        const int step = kb * 16 + 8 * n + 2 * q + s;
                        const int xb = __ldg(xl + 4 * step);
                        const int2 x32 = xsl[4 * step];
                        unsigned a[4];
#pragma unroll
                        for (int r = 0; r < 4; ++r) {
                            const unsigned l = part(q & 1 ? qb : qa, r), hb = part(qh, r);
                            const unsigned lo = (q < 2 ? l : l >> 4) & 0x0F0F0F0Fu;
                            const unsigned hi = (q == 0 ? hb << 4 : q == 1 ? hb << 2 : q == 2 ? hb : hb >> 2);
                            a[r] = lo | (hi & 0x30303030u);
                        }
                        int c0[4] = {x32.x, x32.y, x32.x, x32.y}, c1[4] = {x32.x, x32.y, x32.x, x32.y};
                        mma_u8s8(c0, a[0], a[1], xb);  // rows 4g, 4g + 1 as mma rows g, g + 8
                        mma_u8s8(c1, a[2], a[3], xb);  // rows 4g + 2, 4g + 3
                        const int b = (2 * q + s) & 3;  // the step's scale: byte b of scale word (2q + s) / 4
#pragma unroll
                        for (int r = 0; r < 4; ++r) {
                            const unsigned sw = part(2 * q + s < 4 ? sc0 : sc1, r);
                            const int ls = (int)prmt(sw, 0, 0x8880u | (unsigned)(b * 0x1111));  // signed byte
                            const int* c = r < 2 ? c0 : c1;
                            isum[r][0] += c[2 * (r & 1)] * ls;
                            if (NCOL > 1) isum[r][1] += c[2 * (r & 1) + 1] * ls;
                        }
                    }
                }
            }
            const float x0 = __ldg(xd0 + kb), x1 = __ldg(xd1 + kb);
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const float d = (kb & 1) ? f16_hi(part(dd, r)) : f16_lo(part(dd, r));
                acc[r][0] = fmaf((float)isum[r][0] * d, x0, acc[r][0]);
                if (NCOL > 1) acc[r][1] = fmaf((float)isum[r][1] * d, x1, acc[r][1]);
            }
        }
#if PDL
        if (tile + gridDim.x >= tiles) asm volatile("griddepcontrol.launch_dependents;");
#endif
        NEXT_PREFETCH(tile + gridDim.x >= tiles)
        store_tile(red, acc, wid, gq, t, tile, N, y, stride_y);
    }
}
"""


def kernel_source(columns: int, out_kind: int, pdl: bool = False, evict: int = 0,
                  prefetch: bool = False) -> str:
    return (with_prefetch(_SOURCE, prefetch).replace("__OUT_KIND__", str(out_kind))
            .replace("__NCOL__", str(columns))
            .replace("__WARPS__", str(WARPS)).replace("__PDL__", str(int(pdl)))
            .replace("__EVICT__", str(evict)))


def smem_bytes(in_features: int) -> int:
    """The activation's per-16 sums of 8 columns and the warps' partial sums."""
    return in_features // 16 * 8 * 4 + WARPS * 32 * 8 * 4


@functools.cache
def _compiled(columns: int, out_kind: int, pdl: bool, evict: int = 0, prefetch: bool = False):
    kernel = torch.cuda._compile_kernel(kernel_source(columns, out_kind, pdl, evict, prefetch), "q6k_il_mma")
    kernel.set_shared_memory_config(_smem_optin(torch.device("cuda", torch.cuda.current_device())))
    return kernel


def gemv_q6il(words: torch.Tensor, xa: QuantizedActivation, out_features: int) -> torch.Tensor:
    """`(q·d) @ Wᵀ -> [n, out_features]` in `xa.dtype`, W the q6il words (CUDA) and xa the int8 activation of
    1-8 columns with one scale per 256 inputs."""
    n, k = xa.q.shape
    check_q6il(words, out_features, k)
    check_call("q6il", words, xa, 256)
    tiles = q6il_shape(out_features, k)[0]
    props = torch.cuda.get_device_properties(words.device)
    ctas = min(tiles, 2 * props.multi_processor_count)
    y = torch.empty((n, out_features), dtype=xa.dtype, device=words.device)
    pdl = pdl_enabled()
    following = next_prefetch("q6il", words, ctas, tiles, ctas)
    kernel = _compiled(n, _OUT_KINDS[xa.dtype], pdl, evict=evict_level("q6il"), prefetch=bool(following))
    _launch(kernel, ctas, 32 * WARPS, smem_bytes(k),
            [words, xa.words, xa.d, y, out_features, k, y.stride(0), *following], pdl)
    return y


def q6il_wanted(format: str, out_features: int, in_features: int, device: torch.device | str) -> bool:
    """Whether a resident weight takes the q6il layout: q6_k on CUDA where the kernel compiles, on matrices of
    at least `HEAD_ROWS` rows (the output heads). NINFER_Q6K_IL=0 turns it off, =1 takes every q6_k matrix
    (the tiny fixtures' tests)."""
    policy = os.environ.get("NINFER_Q6K_IL", "")
    if format.removeprefix("gguf_") != "q6_k" or torch.device(device).type != "cuda" or policy == "0":
        return False
    wanted = policy == "1" or out_features >= HEAD_ROWS
    return wanted and in_features % 256 == 0 and _compiles()


@functools.cache
def _compiles() -> bool:
    return builds(lambda: _compiled(1, _OUT_KINDS[torch.bfloat16], False))


def q6il_matmul(words: torch.Tensor, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """`x [..., K] @ Wᵀ -> [..., N]` in x's dtype, W the q6il words (`LaneLayout.matmul`: the GEMV through 16
    columns, unpacked chunks for `quant_matmul` beyond)."""
    return LAYOUT.matmul(words, x, out_features, gemv_q6il)


def gemv_q6il_reference(words: torch.Tensor, xa: QuantizedActivation, out_features: int) -> torch.Tensor:
    """The oracle: the unpacked GGUF rows dequantised, times the dequantised int8 activation, float64."""
    return gemv_q8_reference(unpack_q6il(words, out_features, xa.q.shape[1]), "q6_k", xa, out_features)
