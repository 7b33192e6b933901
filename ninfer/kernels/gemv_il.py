"""iq3_s decode GEMV on a lane-per-row layout ("il32"), CUDA C compiled at run time by NVRTC.

The GGUF iq3_s block is 110 bytes, so the decode GEMVs that read it in place (`gemv_rows_iq`, 8 lanes a
block) load words that straddle lines and re-read the int8 activation for every row: 30-43 % of copy on the
H200 (gpu-notes "Session 8"). For the matrices where that costs most (many rows over a short input: the 27B's
q|k|v, GDN input and gate|up projections) the weight is repacked once at load, losslessly and at the same
size, so that one lane owns one row (since session 29 every iq3_s matrix of ≥ 5120 rows: the output
projections too):

- per row, a pair of blocks (220 bytes) becomes 55 aligned words: the qs of both blocks (32 words), qh (4),
  signs (16), scales (2), then both d in one word (`repack_il32`; `unpack_il32` inverts it);
- word j of pair p of the rows of 32-row tile t lies at `((t·P + p)·55 + j)·32 + r`, r the row in the tile:
  a warp's load of word j is one aligned 128-byte line, all of it used;
- the activation is the same for the warp's 32 rows (a broadcast load from shared memory, where each CTA
  stages it first), the grid sits in shared memory as 16 copies side by side (lane L reads copy L mod 16).

A CTA of `warps` warps takes a tile, warp s the pairs s, s + warps, ... (split-K inside the CTA, summed
through shared memory; the next block's words load while one is used); CTAs loop over the tiles. Rows are
padded to 32 and blocks to an even count with zero blocks (d = 0): no padding on the 27B's matrices. H200,
1 column (GGUF route → il32, session 28 run 4): 34816×5120 44.7 → 30.9 µs, 16480×5120 22.1 → 15.8, 5120×17408
26.4 → 22.6; 5120×6144 10.7 → 9.1 (session 29, both kernels launched as programmatic dependent launches:
`_launch`).

That dp4a kernel costs a dp4a and a shared-memory activation load a grid word per column (92 µs at 8
columns on 34816×5120, session 26). From 3 columns a second kernel (`iq3s_il_mma`, `_MMA_SOURCE`) decodes
each grid word once into int8 mma fragments and multiplies all columns (up to 8) in one tensor-core
instruction: 34816×5120 at 4 / 8 columns 61.6 / 92.4 → 48.3 / 52.2 µs, 16480×5120 29.4 / 43.8 → 24.3 / 26.4
(sessions 27, 28); 37.5 / 39.8 and 18.4 / 19.5 since session 33 (the activation per 256, the sign by xor 0xFE,
fewer ALU ops: that pipe is its limit). Prefill (more
than 16 columns) decodes the words to a transient bf16 matrix in one Triton pass (`dequantize_il32`).

Triton 3.6 has no indexed shared-memory load, hence CUDA C (`torch.cuda._compile_kernel`, NVRTC from the
torch wheel; the launches capture into CUDA graphs). The kernels' oracle is `gemv_il_reference` (float64);
`tests/test_gemv_il.py` checks the layout and both kernels' integer recipes on the CPU.
"""

from __future__ import annotations

import ctypes
import functools
import os
import weakref
from dataclasses import dataclass, replace

import torch

from ninfer.kernels.gemv_q8 import QuantizedActivation, gemv_q8_reference, quantize_activation_cached
from ninfer.kernels.gemv_rows import split_workspace
from ninfer.kernels.gguf_matmul import (
    QuantKernelError,
    _tables,
    dense_out,
    dequantize_rows,
    matmul_by_rows,
)
from ninfer.kernels.lane_layout import tile_rows
from ninfer.kernels.triton_support import HAVE_TRITON, jit, pdl_enabled, tl, triton_runs_on

BLOCK_BYTES = 110
PAIR_WORDS = 55
MAX_COLUMNS = 8
_OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# (start, end) bytes of a block's qs, qh, signs, scales and d: the order of a pair's words
_FIELDS = ((2, 66), (66, 74), (74, 106), (106, 110), (0, 2))


def il32_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """(32-row tiles, block pairs) of the layout."""
    return -(-out_features // 32), -(-(in_features // 256) // 2)


def repack_il32(raw: torch.Tensor) -> torch.Tensor:
    """iq3_s rows `raw` (uint8 `[N, nblk·110]`) as the int32 words of the lane-per-row layout (module doc),
    `[tiles · pairs · 55 · 32]`, on raw's device."""
    n, row_bytes = raw.shape
    nblk = row_bytes // BLOCK_BYTES
    tiles, pairs = il32_shape(n, nblk * 256)
    blocks = torch.zeros((tiles * 32, 2 * pairs, BLOCK_BYTES), dtype=torch.uint8, device=raw.device)
    blocks[:n, :nblk] = raw.reshape(n, nblk, BLOCK_BYTES)
    both = blocks.view(tiles * 32, pairs, 2, BLOCK_BYTES)
    words = torch.cat([both[..., a:b].reshape(tiles * 32, pairs, -1) for a, b in _FIELDS], dim=-1)
    words = words.contiguous().view(torch.int32)  # [rows, pairs, 55]
    return words.view(tiles, 32, pairs, PAIR_WORDS).permute(0, 2, 3, 1).contiguous().reshape(-1)


def unpack_il32(words: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The GGUF rows `[out_features, in_features/256 · 110]` back from `repack_il32`'s words."""
    tiles, pairs = il32_shape(out_features, in_features)
    w = words.view(tiles, pairs, PAIR_WORDS, 32).permute(0, 3, 1, 2).contiguous()
    b = w.view(torch.uint8).view(tiles * 32, pairs, 4 * PAIR_WORDS)
    qs, qh, sg, sc, d = b.split([2 * (end - start) for start, end in _FIELDS], dim=-1)
    per_block = [t.reshape(tiles * 32, pairs, 2, -1) for t in (d, qs, qh, sg, sc)]
    whole = torch.cat(per_block, dim=-1).reshape(tiles * 32, 2 * pairs * BLOCK_BYTES)
    return whole[:out_features, : in_features // 256 * BLOCK_BYTES].contiguous()


def il32_wanted(format: str, out_features: int, in_features: int, device: torch.device | str) -> bool:
    """Whether a resident weight takes the il32 layout: iq3_s on CUDA where NVRTC works, on matrices of at
    least 5120 rows or more than 8192 inputs (the H200's gains, module doc: with programmatic dependent
    launch the 27B's 5120×6144 output projections gained too, 10.7 → 9.1 µs at 1 column, IQ3_S tg128 168.2 →
    172.4; session 29). NINFER_IQ3S_IL=0 turns it off, =1 takes every iq3_s matrix (the tiny fixtures'
    tests)."""
    policy = os.environ.get("NINFER_IQ3S_IL", "")
    if format.removeprefix("gguf_") != "iq3_s" or torch.device(device).type != "cuda" or policy == "0":
        return False
    wanted = policy == "1" or out_features >= 5120 or in_features > 8192
    return wanted and in_features % 256 == 0 and nvrtc_available()


@functools.cache
def nvrtc_available() -> bool:
    """The kernel compiles here: torch's NVRTC front end (a private torch API, so checked, never assumed) on
    a GPU of compute capability 8.0 or later (bf16 conversions)."""
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "_compile_kernel"):
        return False
    if torch.cuda.get_device_capability()[0] < 8:
        return False
    try:
        for columns in (1, 4):  # the dp4a and the tensor-core kernel
            _compiled(columns, _OUT_KINDS[torch.bfloat16], il_schedule(columns, 5120))
    except Exception:  # noqa: BLE001 - any NVRTC or driver failure means: keep the GGUF layout
        return False
    return True


# PTX helpers shared by the NVRTC kernels (`bench/nvrtc_iq3s.py` too): `out_t` and `to_out` follow OUT_KIND
# (0 float32, 1 bfloat16, 2 float16), which the source defines before them.
CUDA_HELPERS = r"""
#if OUT_KIND == 0
typedef float out_t;
#else
typedef unsigned short out_t;
#endif

__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned s) {
    unsigned r; asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s)); return r;
}
__device__ __forceinline__ int dp4a(unsigned a, int b, int c) {
    int r; asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c)); return r;
}
__device__ __forceinline__ unsigned lds(unsigned addr) {
    unsigned r; asm volatile("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(addr)); return r;
}
__device__ __forceinline__ float f16_lo(unsigned v) {
    float f; asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, l;}" : "=f"(f) : "r"(v)); return f;
}
__device__ __forceinline__ float f16_hi(unsigned v) {
    float f; asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, h;}" : "=f"(f) : "r"(v)); return f;
}
// weight loads (each weight byte is read once a round): EVICT 0 plain, 1 not kept in L1, 2 also marked
// evict-first in L2 (what the small kernels reuse between launches may stay there)
#ifndef EVICT
#define EVICT 0
#endif
#if EVICT == 2
__device__ __forceinline__ unsigned long long evict_first() {  // an L2 policy: what it brings in goes first
    unsigned long long pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}
#endif
__device__ __forceinline__ uint4 ldw4(const uint4* p) {
#if EVICT == 2
    uint4 v;
    const unsigned long long pol = evict_first();
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
    return v;
#elif EVICT == 1
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#else
    return *p;
#endif
}
__device__ __forceinline__ unsigned ldw(const unsigned* p) {
#if EVICT == 2
    unsigned v;
    const unsigned long long pol = evict_first();
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.u32 %0, [%1], %2;" : "=r"(v) : "l"(p), "l"(pol));
    return v;
#elif EVICT == 1
    unsigned v;
    asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
#else
    return *p;
#endif
}
// the next GEMV's first weight bytes asked into L2 as this one's CTAs finish their last tile (NEXT 1, the
// arguments `next_prefetch` gives): runs of `next_run` bytes `next_stride` apart, cut at `next_bytes`; CTA b
// asks for runs b, b + gridDim.x, ..., one bulk prefetch each (16-byte multiples; sm_90, before that nothing)
#ifndef NEXT
#define NEXT 0
#endif
#if NEXT
#define NEXT_PARAMS , const char* __restrict__ next_w, unsigned next_bytes, unsigned next_stride, \
                    unsigned next_run, unsigned next_runs
__device__ __forceinline__ void prefetch_l2(const char* p, unsigned bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
#endif
}
#define NEXT_PREFETCH(last)                                                                               \
    if ((last) && threadIdx.x == 0)                                                                       \
        for (unsigned r_ = blockIdx.x; r_ < next_runs; r_ += gridDim.x) {                                 \
            const unsigned at_ = r_ * next_stride;                                                        \
            if (at_ < next_bytes) prefetch_l2(next_w + at_, min(next_run, next_bytes - at_));             \
        }
#else
#define NEXT_PARAMS
#define NEXT_PREFETCH(last)
#endif
__device__ __forceinline__ out_t to_out(float v) {
#if OUT_KIND == 0
    return v;
#elif OUT_KIND == 1
    unsigned short r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v)); return r;
#else
    unsigned short r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v)); return r;
#endif
}

"""

# The epilogue of the il32 and q4il kernels' CONV builds (bf16 columns: `lane_conv`): the GDN decode conv of
# the first `c` outputs of each column, the arithmetic of `gdn_decode.conv_epilogue_store` on each output as
# stored. CONV is the positions a lane: column m is position m % CONV of lane m / CONV; at CONV > 1 (a
# verification span) a thread a lane and row runs the lane's CONV convs in order on the outputs as stored,
# after a barrier (`conv_span`).
CONV_STAGE = r"""
#if CONV
// the kernels' last parameters (`conv_arguments`): weights [C, 4], slots, slot ids, the conv's output
// [NCOL, C], C, the slots' stride, the slot ids' step in 32-bit words (1: int32, 2: int64)
#define CONV_PARAMS , const float4* __restrict__ cw, float* __restrict__ cs, const int* __restrict__ cslot, \
    float* __restrict__ co, int conv_c, int s_cs, int ids_step
struct ConvArgs {
    const float4* w; float* slots; const int* slot_ids; float* out; int c; int s_cs; int step;
};
// output `row` of column m (lane m's token): its conv channel through lane m's slot
__device__ __forceinline__ void conv_store(const ConvArgs& cv, int m, int row, out_t y) {
    if (row >= cv.c) return;
    float* cp = cv.slots + (size_t)cv.slot_ids[m * cv.step] * cv.s_cs + row * 3;  // oldest input first
    const float4 w = cv.w[row];
    const float x = __uint_as_float((unsigned)y << 16), s0 = cp[0], s1 = cp[1], s2 = cp[2];
    const float acc = w.x * s0 + w.y * s1 + w.z * s2 + w.w * x;
    cv.out[m * cv.c + row] = acc / (1.f + expf(-acc));
    cp[0] = s1;
    cp[1] = s2;
    cp[2] = x;
}
#if CONV > 1
// output `row` of lane `lane`'s CONV columns, read back from y where this CTA stored them (before a
// barrier): the lane's convs in order, its slot moved on by all of them (the epilogues run it after their
// stores, apart: the earlier columns' sums made again in the store loop cost the tensor-core kernel's main
// loop ~10 % more ALU work in ptxas's build, session 73). Every input is loaded first, with the slot's and
// the weights' loads in flight beside them: a load a conv between the stores (which may alias y as far as
// the compiler knows) made a chain of CONV + 2 memory round trips after every tile (session 74).
__device__ __forceinline__ void conv_span(const ConvArgs& cv, int lane, int row, const out_t* y,
                                          int stride_y) {
    if (row >= cv.c) return;
    float x[CONV];
#pragma unroll
    for (int p = 0; p < CONV; ++p)
        x[p] = __uint_as_float((unsigned)y[(lane * CONV + p) * stride_y + row] << 16);
    float* cp = cv.slots + (size_t)cv.slot_ids[lane * cv.step] * cv.s_cs + row * 3;
    const float4 w = cv.w[row];
    float s0 = cp[0], s1 = cp[1], s2 = cp[2];
#pragma unroll
    for (int p = 0; p < CONV; ++p) {
        const float acc = w.x * s0 + w.y * s1 + w.z * s2 + w.w * x[p];
        cv.out[(lane * CONV + p) * cv.c + row] = acc / (1.f + expf(-acc));
        s0 = s1;
        s1 = s2;
        s2 = x[p];
    }
    cp[0] = s0;
    cp[1] = s1;
    cp[2] = s2;
}
// a 32-row tile's spans once its outputs are stored (every thread of the CTA calls it): a barrier, then a
// thread a lane and row
__device__ __forceinline__ void conv_spans(const ConvArgs& cv, int tile, int N, const out_t* y,
                                           int stride_y) {
    __syncthreads();
    for (int i = threadIdx.x; i < 32 * (NCOL / CONV); i += WARPS * 32)
        if (tile * 32 + (i & 31) < N) conv_span(cv, i >> 5, tile * 32 + (i & 31), y, stride_y);
}
// the same for the il32 kernels' ring: its k tiles, the last `last`, each gridDim.x after the one before
__device__ __forceinline__ void conv_ring_spans(const ConvArgs& cv, int last, int k, int N,
                                                const out_t* y, int stride_y) {
    __syncthreads();
    for (int i = threadIdx.x; i < k * 32 * (NCOL / CONV); i += WARPS * 32) {
        const int j = i / (32 * (NCOL / CONV)), b = (i >> 5) % (NCOL / CONV);  // b: the span's lane
        const int row = (last - (k - 1 - j) * (int)gridDim.x) * 32 + (i & 31);
        if (row < N) conv_span(cv, b, row, y, stride_y);
    }
}
#endif
#define CONV_ARGS const ConvArgs cv = {cw, cs, cslot, co, conv_c, s_cs, ids_step};
#else
#define CONV_PARAMS
#define CONV_ARGS
#endif
"""

_SOURCE = r"""
#define OUT_KIND __OUT_KIND__
#define NCOL __NCOL__
#define WARPS __WARPS__
#define MIN_CTAS __MIN_CTAS__
#define COPIES __COPIES__
#define PDL __PDL__
#define GROUP __GROUP__
#define CONV __CONV__
#define AHEAD __AHEAD__
#define EVICT __EVICT__
""" + CUDA_HELPERS + CONV_STAGE + r"""
struct Blk { unsigned qs[16], sg[8], qh0, qh1, sc, dw; };  // one block's words (dw: d of both blocks)

// the words of block kb of the tile whose pairs start at `first` (this lane's row): half kb % 2 of pair
// kb / 2
__device__ __forceinline__ void load_block(Blk& b, const unsigned* __restrict__ w, size_t first, int kb,
                                           unsigned lane) {
    const int h = kb & 1;
    const unsigned* wp = w + (first + (kb >> 1)) * (55 * 32) + lane;
#pragma unroll
    for (int i = 0; i < 16; ++i) b.qs[i] = ldw(wp + (16 * h + i) * 32);
#pragma unroll
    for (int i = 0; i < 8; ++i) b.sg[i] = ldw(wp + (36 + 8 * h + i) * 32);
    b.qh0 = ldw(wp + (32 + 2 * h) * 32);
    b.qh1 = ldw(wp + (33 + 2 * h) * 32);
    b.sc = ldw(wp + (52 + h) * 32);
    b.dw = ldw(wp + 54 * 32);
}

// block h of pair p of tile t (P pairs a tile): at one column counted in blocks from the tile's first pair,
// at two from the pair. The same words; ptxas builds the two differently (H200 graphed IQ3_S rounds, session
// 39: one lane 5.46 → 5.36 ms counted from the tile, two lanes 5.82 → 5.90 ms so): each width its faster.
// (`first`: the tile's first pair, t · P)
#if NCOL == 1
#define LOAD_PAIR(b, t, first, p, h) load_block(b, w, first, 2 * (p) + (h), lane)
#else
#define LOAD_PAIR(b, t, first, p, h) load_block(b, w, (size_t)(t) * P + (p), h, lane)
#endif

// acc[m] += this row's block (sub-blocks sb0 .. sb0 + 7) · column m of the activation (in shared memory; its
// scales xds: KG = K / GROUP a column)
__device__ __forceinline__ void dot_block(const Blk& b, int h, int sb0, const int* xs, const float* xds,
                                          int K4, int KG, unsigned tab, float acc[NCOL]) {
    const float d = h ? f16_hi(b.dw) : f16_lo(b.dw);
#if GROUP == 256
    int isum[NCOL];  // Σ_j (1 + 2 scale_j) · dot_j of the block: one float conversion a block
#pragma unroll
    for (int m = 0; m < NCOL; ++m) isum[m] = 0;
#endif
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const unsigned qh = ((j < 4 ? b.qh0 : b.qh1) >> (8 * (j & 3))) & 0xffu;
#if GROUP != 256
        const float dl = d * (float)(1 + 2 * ((b.sc >> (4 * j)) & 15u));
#endif
        int ig[NCOL];
#pragma unroll
        for (int m = 0; m < NCOL; ++m) ig[m] = 0;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            // qh bits of grid words 4 half .. 4 half + 3, one per byte
            const unsigned hs = (((qh >> (4 * half)) & 15u) * 0x204081u) & 0x01010101u;
            const unsigned q = b.qs[2 * j + half];
            int4 xv[NCOL];
#pragma unroll
            for (int m = 0; m < NCOL; ++m)
                xv[m] = reinterpret_cast<const int4*>(xs + m * K4 + (sb0 + j) * 8)[half];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const unsigned idx = prmt(q, hs, 0xCC40 + 0x11 * e);  // qs byte | qh bit << 8
                // signs of grid word 4 half + e: nibble e & 1 of sign byte 2 half + e / 2; bit k moved to the
                // top of byte 3 - k, then each byte filled with its top bit
                const unsigned byte = prmt(b.sg[j], 0, 0x4440 + 2 * half + (e >> 1));
                const unsigned m8 = prmt(byte * ((e & 1) ? 0x08040201u : 0x80402010u), 0, 0x89AB);
                // the grid's magnitudes are odd, so g ^ 0xFE is -g in a byte: the signed word in one LOP3
                const unsigned sw = lds(tab + idx * (4 * COPIES)) ^ (m8 & 0xFEFEFEFEu);
#pragma unroll
                for (int m = 0; m < NCOL; ++m) {
                    const int xe = e == 0 ? xv[m].x : e == 1 ? xv[m].y : e == 2 ? xv[m].z : xv[m].w;
                    ig[m] = dp4a(sw, xe, ig[m]);
                }
            }
        }
#if GROUP == 256
        const int ls = (int)(((b.sc >> (4 * j)) & 15u) * 2u + 1u);
#pragma unroll
        for (int m = 0; m < NCOL; ++m) isum[m] += ig[m] * ls;
#else
#pragma unroll
        for (int m = 0; m < NCOL; ++m) acc[m] += dl * xds[m * KG + sb0 + j] * (float)ig[m];
#endif
    }
#if GROUP == 256
#pragma unroll
    for (int m = 0; m < NCOL; ++m) acc[m] += d * xds[m * KG + (sb0 >> 3)] * (float)isum[m];
#endif
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_CTAS)
iq3s_il_gemv(const unsigned* __restrict__ w, const int* __restrict__ xw, const float* __restrict__ xd,
             const unsigned* __restrict__ grid, out_t* __restrict__ y, int N, int K, int stride_y, int ring
             CONV_PARAMS NEXT_PARAMS)
{
    CONV_ARGS
    extern __shared__ unsigned smem[];
    const int P = (K + 511) >> 9, K4 = K >> 2, KG = K >> (GROUP == 256 ? 8 : 5), nblk = K >> 8;
    const unsigned lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int tiles = (N + 31) >> 5;
    // the warps' sums of the CTA's last `ring` tiles [ring][WARPS][NCOL][32]: summed and written every `ring`
    // tiles (one barrier there, not two a tile)
    float* red = (float*)(smem + 512 * COPIES);
    int* xs = reinterpret_cast<int*>(red + ring * WARPS * NCOL * 32);  // the activation [NCOL][K4]
    float* xds = reinterpret_cast<float*>(xs + NCOL * K4);
    // what the CTA needs first is asked for at once (one memory latency, not one a pass of a fill loop): its
    // first block (AHEAD 1; AHEAD 0: after the wait), the grid words of its table, the activation
    Blk a, b;
#if AHEAD
    if (blockIdx.x < tiles && wid < P) LOAD_PAIR(a, blockIdx.x, (size_t)blockIdx.x * P, wid, 0);
#endif
    // table entry i of copy c at i * COPIES + c, 16 bytes (four copies of the word) a store
    constexpr int STORES = 128 * COPIES, FILL = (STORES + WARPS * 32 - 1) / (WARPS * 32);
    unsigned gw[FILL];
#pragma unroll
    for (int r = 0; r < FILL; ++r) {
        const int i = threadIdx.x + r * WARPS * 32;
        gw[r] = i < STORES ? __ldg(grid + i * 4 / COPIES) : 0u;
    }
#if PDL
    // launched early (programmatic dependent launch): the activation is the previous kernel's output
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#if !AHEAD
    if (blockIdx.x < tiles && wid < P) LOAD_PAIR(a, blockIdx.x, (size_t)blockIdx.x * P, wid, 0);
#endif
    // the activation, read by every warp of the CTA, from shared memory (a global load's latency stalled the
    // sub-blocks: gpu-notes "Session 28")
    for (int i = threadIdx.x; i < NCOL * K4 / 4; i += WARPS * 32)
        reinterpret_cast<int4*>(xs)[i] = __ldg(reinterpret_cast<const int4*>(xw) + i);
    for (int i = threadIdx.x; i < NCOL * KG; i += WARPS * 32) xds[i] = __ldg(xd + i);
#pragma unroll
    for (int r = 0; r < FILL; ++r) {
        const int i = threadIdx.x + r * WARPS * 32;
        if (i < STORES) reinterpret_cast<uint4*>(smem)[i] = make_uint4(gw[r], gw[r], gw[r], gw[r]);
    }
    __syncthreads();
    const unsigned tab = (unsigned)__cvta_generic_to_shared(smem) + 4 * (lane % COPIES);
    int k = 0;  // the tile's place in the ring
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        float acc[NCOL];
#pragma unroll
        for (int m = 0; m < NCOL; ++m) acc[m] = 0.f;
        // blocks in flight: the next block's words load while this one is used
        const size_t first = (size_t)t * P;
        if (t != blockIdx.x && wid < P) LOAD_PAIR(a, t, first, wid, 0);
        for (int p = wid; p < P; p += WARPS) {
            LOAD_PAIR(b, t, first, p, 1);  // the padding block of an odd count is zeros
            dot_block(a, 0, 16 * p, xs, xds, K4, KG, tab, acc);
            if (p + WARPS < P) LOAD_PAIR(a, t, first, p + WARPS, 0);
            if (2 * p + 1 < nblk) dot_block(b, 1, 16 * p + 8, xs, xds, K4, KG, tab, acc);
        }
#if PDL
        if (t + gridDim.x >= tiles) asm volatile("griddepcontrol.launch_dependents;");
#endif
        NEXT_PREFETCH(t + gridDim.x >= tiles)
        if (WARPS == 1) {
            const int row = t * 32 + lane;
            if (row < N) {
#pragma unroll
                for (int m = 0; m < NCOL; ++m) {
                    y[m * stride_y + row] = to_out(acc[m]);
#if CONV == 1
                    conv_store(cv, m, row, to_out(acc[m]));
#endif
                }
#if CONV > 1
                // (the thread's own stores)
                for (int b = 0; b < NCOL / CONV; ++b) conv_span(cv, b, row, y, stride_y);
#endif
            }
            continue;
        }
#pragma unroll
        for (int m = 0; m < NCOL; ++m) red[((k * WARPS + wid) * NCOL + m) * 32 + lane] = acc[m];
        if (++k < ring && t + gridDim.x < tiles) continue;
        __syncthreads();
        // tiles t - (k - 1) gridDim.x .. t
        for (int i = threadIdx.x; i < k * NCOL * 32; i += WARPS * 32) {
            const int j = i / (NCOL * 32), m = (i >> 5) % NCOL;
            const int row = (t - (k - 1 - j) * gridDim.x) * 32 + (i & 31);
            float v = 0.f;
#pragma unroll
            for (int s = 0; s < WARPS; ++s) v += red[((j * WARPS + s) * NCOL + m) * 32 + (i & 31)];
            if (row < N) y[m * stride_y + row] = to_out(v);
#if CONV == 1
            if (row < N) conv_store(cv, m, row, to_out(v));
#endif
        }
#if CONV > 1
        conv_ring_spans(cv, t, k, N, y, stride_y);  // the ring's outputs stored: each lane's convs
#endif
        k = 0;
        if (t + gridDim.x < tiles) __syncthreads();
    }
}
"""


# The same GEMV on int8 tensor cores (`mma.sync.m16n8k32.s8`), for 3-8 columns: the decode of a weight word is
# shared by every column and the columns' products are one mma, so the cost hardly grows with the columns.
# Lane 4g + t of a warp owns rows 4g .. 4g + 3 of the tile (one 16-byte load of a word serves all four: the
# warp's load is the whole 128-byte line, each 16 bytes read by 4 lanes) and grid words 2t, 2t + 1 of every
# sub-block (qs bytes 2t, 2t + 1, sign byte t; the order of k inside an mma is free as long as A and B agree).
# Mma rows g / g + 8 of the first m16 tile are rows 4g / 4g + 1, of the second 4g + 2 / 4g + 3. The grid sits
# in shared memory as 32 interleaved copies (lane L reads copy L: a warp's loads never share a bank); the
# grid's magnitudes are odd, so a byte xor 0xFE negates it and the sign bits give the signed word in one LOP3
# (both kernels). Each
# sub-block's mma starts from the int32 bits of 1.5·2^23, so its float view minus 1.5·2^23 is the exact sum
# (|sum| <= 32·15·127 < 2^22), then scaled by the row's d·(1 + 2·scale) and the column's activation scale.
# Measured slower (gpu-notes "Session 39"; rebuilt by mistake in session 78: 758 → 703 instructions a block,
# its ALU pipe busier): at 3-4 columns two sub-blocks an mma (B columns 0-3 one's, 4-7 the next's, so a lane
# weighs its sums by one sub-block scale a pair) — 7 % fewer instructions, 3-6 % slower alone, the graphed
# 4-column step 7.34 → 7.64-7.75 ms: this kernel waits on its dependent chains (table load after index, mma
# after its words, a chained mma's sums), not on issue.
_MMA_SOURCE = r"""
#define OUT_KIND __OUT_KIND__
#define NCOL __NCOL__
#define WARPS __WARPS__
#define MIN_CTAS __MIN_CTAS__
#define PDL __PDL__
#define GROUP __GROUP__
#define CONV __CONV__
#define EVICT __EVICT__
""" + CUDA_HELPERS + CONV_STAGE + r"""
#define BIAS 0x4B400000
__device__ __forceinline__ unsigned part(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
__device__ __forceinline__ void mma_s8(int (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                       int b0, int b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned mul_hi(unsigned a, unsigned b) {
    unsigned r; asm("mul.hi.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b)); return r;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_CTAS)
iq3s_il_mma(const uint4* __restrict__ w, const int* __restrict__ xw, const float* __restrict__ xd,
            const unsigned* __restrict__ grid, out_t* __restrict__ y, int N, int K, int stride_y,
            int splits, float* __restrict__ part_sums, int* __restrict__ counts, int ring CONV_PARAMS
            NEXT_PARAMS)
{
    CONV_ARGS
    // split-K (`splits` > 1): item i is piece i % splits of tile i / splits, a run of its blocks; each
    // piece leaves its sums in its slot of part_sums [splits][NCOL][tiles * 32], and the last piece to finish
    // (a count per tile, left zero again) adds the slots in piece order: the same bits whichever is last
    extern __shared__ uint4 tab[];  // grid word i of copy c at word i * 32 + c, four copies a store
    // the warps' partial sums of the CTA's last `ring` items [ring][WARPS][32 rows][8 columns], summed and
    // written after one barrier (`ring` > 1 only unsplit)
    float* red = reinterpret_cast<float*>(tab + 512 * 8);
    int* last_piece = reinterpret_cast<int*>(red + ring * WARPS * 32 * 8);  // (no static shared memory: the
                                                                     // dynamic size is the opt-in limit)
    for (int i = threadIdx.x; i < 512 * 8; i += WARPS * 32) {
        const unsigned g = grid[i >> 3];
        tab[i] = make_uint4(g, g, g, g);
    }
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");  // the activation is the previous kernel's output
#endif
    __syncthreads();
    const unsigned lane = threadIdx.x & 31, wid = threadIdx.x >> 5, gq = lane >> 2, t = lane & 3;
    const char* tb = reinterpret_cast<const char*>(tab) + 4 * lane;  // this lane's copy
    const unsigned selq = 2 * (t & 1);  // qs byte 2t of the lane's word (2t + 1 the next)
    const unsigned sels = 0x4440 + t;  // sign byte t alone
    const int P = (K + 511) >> 9, K4 = K >> 2, K32 = K >> 5, nblk = K >> 8;
    const int tiles = (N + 31) >> 5;
    // this lane's activation: B words of column gq, scales of columns 2t, 2t + 1 (a valid column where the
    // lane's is past NCOL: those output columns are never stored)
    const int* xl = xw + min((int)gq, NCOL - 1) * K4 + 2 * t;
    // the activation's scales: one per 32 inputs, or (GROUP 256) one per block
    const float* xd0 = xd + min(2 * (int)t, NCOL - 1) * (GROUP == 256 ? nblk : K32);
    const float* xd1 = xd + min(2 * (int)t + 1, NCOL - 1) * (GROUP == 256 ? nblk : K32);
    const int items = tiles * splits;
    int k = 0;  // the item's place in the ring
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
        const int tile = item / splits, piece = item - tile * splits;
        float acc[4][2];
#pragma unroll
        for (int r = 0; r < 4; ++r) { acc[r][0] = 0.f; acc[r][1] = 0.f; }
        const int kb_end = (piece + 1) * nblk / splits;
        for (int kb = piece * nblk / splits + wid; kb < kb_end; kb += WARPS) {
            const int h = kb & 1;
            const uint4* wb = w + (size_t)(tile * P + (kb >> 1)) * (55 * 8) + gq;  // word j at wb[8 j]
            const uint4* wq = wb + 8 * (16 * h + (t >> 1));  // qs word 2 j + t / 2 at wq[16 j]
            const uint4 sc = ldw4(wb + 8 * (52 + h)), dd = ldw4(wb + 8 * 54);
            const int2* xb8 = reinterpret_cast<const int2*>(xl + kb * 64);  // sub-block j at xb8[4 j]
            const float* xdb0 = xd0 + kb * 8;
            const float* xdb1 = xd1 + kb * 8;
            float d[4], d2[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                d[r] = h ? f16_hi(part(dd, r)) : f16_lo(part(dd, r));
                d2[r] = 2.f * d[r];
            }
#if GROUP == 256
            int isum[4][2] = {{0, 0}, {0, 0}, {0, 0}, {0, 0}};  // Σ_j (1 + 2 scale_j) · dot_j of the block
#endif
            // qh bits of grid words 2t / 2t + 1 of four sub-blocks, a byte each (0 or 1), by row: the table
            // index is one prmt of them and the qs word (ALU work is this kernel's limit: session 33)
            unsigned qa[4], qb[4];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if ((j & 3) == 0) {
                    const uint4 qh = ldw4(wb + 8 * (32 + 2 * h + (j >> 2)));
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const unsigned bits = part(qh, r) >> (2 * t);
                        qa[r] = bits & 0x01010101u;
                        qb[r] = (bits >> 1) & 0x01010101u;
                    }
                }
                const uint4 qs = ldw4(wq + 16 * j), sg = ldw4(wb + 8 * (36 + 8 * h + j));
                const int2 xb = __ldg(xb8 + 4 * j);
                // [qs byte 2t or 2t + 1, qh bit, 0, 0] (the top bytes sign-replicate a 0 or 1 byte)
                const unsigned selj = (4 + (j & 3)) * 0x10u + (0xC + (j & 3)) * 0x1100u;
                const unsigned sel_a = selq | selj, sel_b = (selq + 1) | selj;
                unsigned a[4][2];
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    // table offsets of grid words 2t, 2t + 1: (qs byte | qh bit << 8) · 128 + the lane's copy
                    const unsigned ia = prmt(part(qs, r), qa[r], sel_a), ib = prmt(part(qs, r), qb[r], sel_b);
                    const unsigned ea = *reinterpret_cast<const unsigned*>(tb + ia * 128u);
                    const unsigned eb = *reinterpret_cast<const unsigned*>(tb + ib * 128u);
                    // sign bit k of a word to the top of byte 3 - k, each byte filled with its top bit
                    const unsigned sb = prmt(part(sg, r), 0, sels);
                    const unsigned ma = prmt(sb * 0x80402010u, 0, 0x89AB);
                    const unsigned mb = prmt(sb * 0x08040201u, 0, 0x89AB);
                    a[r][0] = ea ^ (ma & 0xFEFEFEFEu);
                    a[r][1] = eb ^ (mb & 0xFEFEFEFEu);
                }
#if GROUP == 256
                // one activation scale a block: the sub-block scales weigh the integer dots, one float
                // conversion a block
                int c0[4] = {0, 0, 0, 0}, c1[4] = {0, 0, 0, 0};
                mma_s8(c0, a[0][0], a[1][0], a[0][1], a[1][1], xb.x, xb.y);
                mma_s8(c1, a[2][0], a[3][0], a[2][1], a[3][1], xb.x, xb.y);
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    // 1 + 2·scale_j by multiplies (the FMA pipe; the ALU pipe is this kernel's limit):
                    // nibble j to the top by a low multiply, down by a high one
                    const unsigned nib = mul_hi(part(sc, r) << (28 - 4 * j), 16u);
                    const int ls = (int)(nib * 2u + 1u);
                    const int* c = r < 2 ? c0 : c1;
                    isum[r][0] += c[2 * (r & 1)] * ls;
                    if (NCOL > 1) isum[r][1] += c[2 * (r & 1) + 1] * ls;
                }
#else
                int c0[4] = {BIAS, BIAS, BIAS, BIAS}, c1[4] = {BIAS, BIAS, BIAS, BIAS};
                mma_s8(c0, a[0][0], a[1][0], a[0][1], a[1][1], xb.x, xb.y);
                mma_s8(c1, a[2][0], a[3][0], a[2][1], a[3][1], xb.x, xb.y);
                const float x0 = __ldg(xdb0 + j), x1 = __ldg(xdb1 + j);
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const unsigned nib = (part(sc, r) >> (4 * j)) & 15u;
                    const float dl = fmaf(__int_as_float(nib | 0x4B000000u) - 8388608.f, d2[r], d[r]);
                    const int* c = r < 2 ? c0 : c1;
                    acc[r][0] = fmaf((__int_as_float(c[2 * (r & 1)]) - 12582912.f) * dl, x0, acc[r][0]);
                    if (NCOL > 1) {
                        const float v = __int_as_float(c[2 * (r & 1) + 1]) - 12582912.f;
                        acc[r][1] = fmaf(v * dl, x1, acc[r][1]);
                    }
                }
#endif
            }
#if GROUP == 256
            const float x0 = __ldg(xd0 + kb), x1 = __ldg(xd1 + kb);
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                acc[r][0] = fmaf((float)isum[r][0] * d[r], x0, acc[r][0]);
                if (NCOL > 1) acc[r][1] = fmaf((float)isum[r][1] * d[r], x1, acc[r][1]);
            }
#endif
        }
#if PDL
        if (item + gridDim.x >= items) asm volatile("griddepcontrol.launch_dependents;");
#endif
        NEXT_PREFETCH(item + gridDim.x >= items)
        // rows 4 gq + r, columns 2t, 2t + 1: summed over the warps through shared memory
        float* rk = red + (k * WARPS + wid) * (32 * 8);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            rk[(4 * gq + r) * 8 + 2 * t] = acc[r][0];
            rk[(4 * gq + r) * 8 + 2 * t + 1] = acc[r][1];
        }
        if (++k < ring && item + gridDim.x < items) continue;
        __syncthreads();
        const int slot = tiles * 32 * NCOL;  // floats a piece's slot
        for (int i = threadIdx.x; i < k * 32 * NCOL; i += WARPS * 32) {
            const int j = i / (32 * NCOL), m = (i >> 5) % NCOL, row = i & 31;
            const int at = (tile - (k - 1 - j) * (int)gridDim.x) * 32 + row;  // of the ring's item j
            float v = 0.f;
#pragma unroll
            for (int s = 0; s < WARPS; ++s) v += red[((j * WARPS + s) * 32 + row) * 8 + m];
            if (splits == 1) {
                if (at < N) y[m * stride_y + at] = to_out(v);
#if CONV == 1
                if (at < N) conv_store(cv, m, at, to_out(v));
#endif
            } else {
                part_sums[piece * slot + m * tiles * 32 + tile * 32 + row] = v;
            }
        }
#if CONV > 1
        if (splits == 1) conv_ring_spans(cv, tile, k, N, y, stride_y);  // the ring's outputs stored
#endif
        if (splits > 1) {
            __threadfence();
            __syncthreads();
            if (threadIdx.x == 0) *last_piece = atomicAdd(counts + tile, 1) == splits - 1;
            __syncthreads();
            if (*last_piece) {
                __threadfence();
                for (int i = threadIdx.x; i < 32 * NCOL; i += WARPS * 32) {
                    const int m = i >> 5, row = i & 31;
                    const float* at = part_sums + m * tiles * 32 + tile * 32 + row;
                    float v = __ldcg(at);
                    for (int p = 1; p < splits; ++p) v += __ldcg(at + p * slot);
                    if (tile * 32 + row < N) y[m * stride_y + tile * 32 + row] = to_out(v);
#if CONV == 1
                    if (tile * 32 + row < N) conv_store(cv, m, tile * 32 + row, to_out(v));
#endif
                }
#if CONV > 1
                conv_spans(cv, tile, N, y, stride_y);  // (every thread of the CTA is here: last_piece is its)
#endif
                if (threadIdx.x == 0) counts[tile] = 0;
            }
        }
        k = 0;
        __syncthreads();
    }
}
"""


@dataclass(frozen=True)
class IlSchedule:
    """`warps` per CTA (split-K over a tile's pairs of blocks), `copies` of the grid in shared memory.
    `kernel` "il_mma": the tensor-core kernel (split-K by blocks, 32 copies of the grid, `regs` registers a
    thread; `copies` does not apply). `group`: the activation's values per scale, 32 or 256: with 256 the
    sub-block scales (1 + 2·nibble) weigh the integer sums and one float conversion a block remains (H200:
    the dp4a kernel 2.5-6 %, the tensor-core kernel 8-14 % faster). Tried and slower on the H200 everywhere
    (gpu-notes "Session 50"; the code is on branch s48-il-staging): a grid table laid out for byte offsets
    (32 copies for the dp4a kernel too), and each warp's sub-blocks staged ahead through shared memory; both
    kernels in clusters of CTAs a tile, as q4il's (gpu-notes "Session 52": the dp4a kernel's graphed IQ3_S
    1-lane round 5.301 → 5.411 ms in clusters of 2, the tensor-core kernel's split pieces as a cluster the
    4-column step 7.254 → 7.559; the code is on branch s52-il-clusters)."""

    warps: int
    copies: int = 16
    kernel: str = "il"
    regs: int = 0
    group: int = 32
    splits: int = 1
    ahead: int = 1

    def __post_init__(self):
        if self.group not in (32, 256):
            raise QuantKernelError(f"activation groups of {self.group}: the il32 kernels take 32 or 256")
        if self.ahead not in (0, 1) or (self.ahead == 0 and self.kernel != "il"):
            raise QuantKernelError(f"{self.ahead} blocks before the wait: the dp4a il32 kernel loads 0 or 1, "
                                   "the tensor-core one 1")
        if self.splits != 1 and self.kernel != "il_mma":
            raise QuantKernelError("split-K over CTAs is the tensor-core il32 kernel's (IlSchedule.splits)")

    @property
    def name(self) -> str:
        if self.kernel == "il_mma":
            return (f"ilmma_w{self.warps}" + (f"_r{self.regs}" if self.regs else "")
                    + (f"_g{self.group}" if self.group != 32 else "")
                    + (f"_s{self.splits}" if self.splits > 1 else ""))
        return (f"il_w{self.warps}_c{self.copies}" + (f"_r{self.regs}" if self.regs else "")
                + (f"_g{self.group}" if self.group != 32 else "")
                + (f"_a{self.ahead}" if self.ahead != 1 else ""))

    def smem_bytes(self, columns: int, in_features: int, ring: int = 1) -> int:
        """The tables and the split-K sums (the dp4a kernel's: of `ring` tiles); the dp4a kernel also stages
        the activation (int8 and scales)."""
        if self.kernel == "il_mma":
            return 512 * 32 * 4 + ring * self.warps * 32 * 8 * 4 + 16
        table = 512 * self.copies * 4
        activation = columns * (in_features + in_features // self.group * 4)  # int8 values, fp32 scales
        return table + ring * self.warps * columns * 32 * 4 + activation


# the blocks the dp4a kernel loads before the programmatic launch's wait (0 or 1; its first pair whole, 2:
# the graphed IQ3_S rounds +0.09 ms at one lane, +0.47 at two on an H100, gpu-notes "Session 55")
IL_AHEAD = 1


def il_schedule(columns: int, in_features: int, out_features: int = 8192, group: int = 32) -> IlSchedule:
    """1-2 columns: the dp4a kernel, a warp per pair of blocks (at most 10 warps), 16 copies of the grid (on
    the H200 within 3 % of the best il schedule at 1 and 2 columns on the 27B's matrices, sessions 26 and
    28). 3-8: the tensor-core kernel, 10 warps of 96 registers (the best or within 4 % of it at 3, 4 and 8
    columns on the 27B's il32 matrices, sessions 27 and 29; session 38 again against 6-12 warps of 80-255
    registers and block loads hoisted or double-buffered), at 3-4 columns over few short rows (`_MMA_SHORT`)
    6 warps of 112 registers, three CTAs an SM (the 27B's output projections, 5120×6144: 11.8 → 11.0 µs at
    4 columns, session 38); a tile's blocks in `mma_splits` pieces across CTAs (NINFER_IL_SPLITS: a count
    instead, for A/B). Both take an activation of one scale per `group` inputs. The dp4a kernel loads the
    CTA's first block before the programmatic launch's wait (`IL_AHEAD` 1; NINFER_IL_AHEAD=0: after it)."""
    return _il_schedule(columns, in_features, out_features, group, os.environ.get("NINFER_IL_SPLITS", "auto"),
                        os.environ.get("NINFER_IL_AHEAD", str(IL_AHEAD)))


@functools.cache  # every il_matmul asks
def _il_schedule(columns: int, in_features: int, out_features: int, group: int, splits: str,
                 ahead: str) -> IlSchedule:
    if columns >= 3:
        blocks = in_features // 256
        short = columns <= _MMA_SHORT[0] and blocks <= _MMA_SHORT[1] and out_features <= _MMA_SHORT[2]
        s = (IlSchedule(min(6, blocks), kernel="il_mma", regs=112, group=group) if short
             else IlSchedule(min(10, blocks), kernel="il_mma", group=group))
        return with_mma_splits(s, columns, in_features, out_features) if splits == "auto" else replace(
            s, splits=int(splits))
    return IlSchedule(min(10, il32_shape(32, in_features)[1]), 16, group=group, ahead=int(ahead))


def with_mma_splits(s: IlSchedule, columns: int, in_features: int, out_features: int) -> IlSchedule:
    """Tensor-core schedule s with the tile splits `mma_splits` gives it on this device's CTA slots."""
    pieces = mma_splits(il32_shape(out_features, in_features)[0], in_features // 256, s.warps,
                        _cta_slots(s, columns))
    return replace(s, splits=pieces)


# columns, blocks a row and rows at most for the tensor-core kernel's schedule of few short rows (il_schedule;
# at 8 columns, one round of 8 lanes, the captured IQ3_S round lost 0.05 ms with it: session 38)
_MMA_SHORT = 4, 24, 8192


def mma_splits(tiles: int, blocks: int, warps: int, slots: int, most: int = 4) -> int:
    """Pieces a tile's `blocks` are split into across CTAs for the tensor-core kernel: only where its tiles
    are fewer than the CTA `slots` (SMs × CTAs an SM holds), as many as leave each of the CTA's `warps` two
    blocks or more a piece. H200, session 32 (`bench/il_splits.py`): the 27B's down projection (160 tiles of
    68 blocks) in 3 pieces 29.9 → 27.4 µs at 4 columns, 31.1 → 29.0 at 8 (4 pieces: 30.2 / 31.9); the
    output projections (24 blocks) in 2-4 pieces and the larger matrices in any are slower (gate|up 43.2 →
    56.3 in 2)."""
    if tiles >= slots:
        return 1
    return max(1, min(most, blocks // (2 * warps)))


def _cta_slots(s: IlSchedule, columns: int) -> int:
    """CTAs of schedule s the current CUDA device holds at once (`_launch_shape`); an H200's 264 (132 SMs ×
    2) where no GPU is."""
    if torch.cuda.is_available():
        return _launch_shape(torch.device("cuda", torch.cuda.current_device()), s, columns, 0)
    return 132 * _ctas_per_sm(s, columns, 0)


_RING = 8  # the dp4a kernel's tiles summed at once, at most (the CTA's tiles on the H200: 5 for gate|up)
# the tensor-core kernel's: on the H200 a ring of 2 is the best or within 0.2 µs of it on the 27B's matrices
# at 3, 4 and 8 columns; 3-5 lose on gate|up (8 columns: 44.0 µs unringed, 43.1 in 2, 46.2 in 4; session 33)
_MMA_RING = 2

# registers a thread the build allows at 1, 2, 4, 8 columns (below these the larger widths spill)
_REGISTERS = {1: 80, 2: 96, 4: 112, 8: 128}
_MMA_REGISTERS = 96


def _ctas_per_sm(s: IlSchedule, columns: int, in_features: int, smem: int = 228 * 1024,
                 threads: int = 2048) -> int:
    """CTAs an SM holds: by shared memory, threads, and registers (`s.regs`, else `_MMA_REGISTERS` or
    `_REGISTERS`)."""
    per_thread = s.regs or (_MMA_REGISTERS if s.kernel == "il_mma"
                            else _REGISTERS[1 << (columns - 1).bit_length()])
    regs = 65536 // (32 * s.warps * per_thread)
    return max(1, min(smem // (s.smem_bytes(columns, in_features) + 1024), threads // (32 * s.warps), regs))


def kernel_source(columns: int, out_kind: int, s: IlSchedule, pdl: bool = False, conv: bool = False,
                  evict: int = 0, prefetch: bool = False) -> str:
    """The CUDA source; its launch bounds ask for the CTAs an SM holds by registers, threads and tables.
    `pdl`: launched as a programmatic dependent launch (`_launch`), it loads its weights and tables before
    waiting for the previous kernel, and lets the next one launch after its last tile's main loop.
    `conv` (bf16 out): the GDN decode conv in its epilogue, its positions a lane (`CONV_STAGE`, `lane_conv`;
    0 none). `evict`: the weight loads' cache hints (`evict_level`). `prefetch`: the next GEMV's first weight
    bytes asked into L2 at the end (`next_prefetch`)."""
    source = with_prefetch(_MMA_SOURCE if s.kernel == "il_mma" else _SOURCE, prefetch)
    if conv and out_kind != _OUT_KINDS[torch.bfloat16]:
        raise QuantKernelError("the il32 conv builds write bf16")
    return (source.replace("__OUT_KIND__", str(out_kind)).replace("__NCOL__", str(columns))
            .replace("__CONV__", str(int(conv)))
            .replace("__WARPS__", str(s.warps)).replace("__MIN_CTAS__", str(_ctas_per_sm(s, columns, 0)))
            .replace("__COPIES__", str(s.copies))
            .replace("__PDL__", str(int(pdl))).replace("__GROUP__", str(s.group))
            .replace("__AHEAD__", str(s.ahead)).replace("__EVICT__", str(evict)))


@functools.cache
def _smem_optin(device: torch.device) -> int:
    """The shared memory a CTA may ask for on `device` (the H200: 227 KB)."""
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 48 * 1024)


@functools.cache
def _smem_sm(device: torch.device) -> int:
    """An SM's shared memory on `device` (the H200: 228 KB)."""
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_multiprocessor", 228 * 1024)


KERNELS = ("il", "il_mma", "q4il", "q6il")  # the NVRTC GEMVs, as their settings name them


def _by_kernel(variable: str, defaults: dict[str, int], what: str, example: str,
               allowed: set[int] | None = None) -> dict[str, int]:
    """A setting of each NVRTC GEMV from environment `variable`: one value for every kernel, kernel=value
    pairs joined by ':' for some (the others 0), or `defaults` where it is unset. `allowed`: the values it
    may take (None: any integer ≥ 0)."""
    forced = os.environ.get(variable, "")
    if not forced:
        return defaults
    pairs = ([item.split("=", 1) for item in forced.split(":")] if "=" in forced
             else [[kernel, forced] for kernel in KERNELS])
    try:
        values = {kernel: int(value) for kernel, value in pairs}
    except ValueError:
        values = {}
    if (len(values) != len(pairs) or not set(values) <= set(KERNELS)
            or any(v < 0 or (allowed is not None and v not in allowed) for v in values.values())):
        raise QuantKernelError(f"{variable}={forced}: {what} for every kernel, or kernel=value pairs joined "
                               f"by ':' ({example}; the kernels: {', '.join(KERNELS)})")
    return values


# The weight loads' cache hints by kernel (`EVICT` in the CUDA C of the il32, q4il and q6il GEMVs): 1 not
# allocated in L1, 2 also evict-first in L2 (a weight byte is read once a round, the small kernels' vectors
# and norm weights again each round); 0 plain loads, as for a kernel not named. NINFER_EVICT=N sets every
# kernel's, NINFER_EVICT=il=2:q6il=1 some (of il, il_mma, q4il, q6il). Graphed rounds, A B B A, min of two
# (gpu-notes "Session 57"): on the H200 the dp4a il32 kernel at 2 takes IQ3_S's 1-lane round 5.307 -> 5.212 ms
# (2 and 8 lanes even; at 1 5.218), the tensor-core one at 2 costs its 4-column step 7.274 -> 7.355 and 8
# lanes 8.051 -> 8.164; q4il at 1 takes Q4_K's 1-lane round 5.299 -> 5.272, 8 lanes 7.934 -> 7.887 (4
# columns even; at 2 it lost on the H100, session 56); the q6il head at 1 or 2 is even.
EVICT: dict[str, int] = {"il": 2, "q4il": 1}


def evict_level(kernel: str) -> int:
    """The cache hints of NVRTC GEMV `kernel`'s weight loads (il, il_mma, q4il, q6il): `EVICT`,
    NINFER_EVICT."""
    levels = _by_kernel("NINFER_EVICT", EVICT, "a level 0, 1 or 2", "il=2:q6il=1", {0, 1, 2})
    return levels.get(kernel, 0)


# The next GEMV's first weight bytes asked into L2 by this one's CTAs as each finishes its last tile (a
# `cp.async.bulk.prefetch.L2` a run, sm_90): the next kernel's first loads after its programmatic-launch wait
# then find L2 instead of HBM, whose bandwidth lies idle in a GEMV's tail and the small kernels after it.
# NINFER_NEXT_PREFETCH=KB sets how many for every kernel, =il=8192:q4il=8192 some kernels' (the others'
# builds as without, 0 none); where unset, `NEXT_PREFETCH_WIDE` on a GPU whose SMs each have at least
# WIDE_GBS_PER_SM of its memory bandwidth (`wide_memory`: the H200), `NEXT_PREFETCH` on others (the H100).
# "Next" is the GEMV launched after this one the last time: a decode round's order is fixed, and the rounds
# run before a graph is captured teach it. Graphed rounds, A B B A (gpu-notes "Sessions 58-60"): 8 MiB is the
# best size (2, 16, 32, 64 less or slower). H100: IQ3_S 1 / 2 lanes -2.9 / -2.3 %, Q4_K 1 lane -3.5 %, 8
# lanes -2.0 %, the suites' tg128 +2.9 / +3.6 %; the tensor-core il32 kernel's own (il_mma: 3-8 columns)
# costs IQ3_S's 4-column step and 4 lanes +1.8 / +2.4 %: left out. H200: q4il's takes Q4_K's 1 lane 5.263 ->
# 5.188 ms and 8 lanes 8.488 -> 8.390 (tg128 185.8 -> 189.0); the dp4a il32 kernel's costs IQ3_S's 1 lane
# 5.209 -> 5.258 (8 lanes even); the head's is even at both.
NEXT_PREFETCH: dict[str, int] = {"il": 8192, "q4il": 8192, "q6il": 8192}
NEXT_PREFETCH_WIDE: dict[str, int] = {"q4il": 8192}
WIDE_GBS_PER_SM = 30.0


@functools.cache
def wide_memory(device: torch.device) -> bool:
    """Whether CUDA `device`'s SMs each have at least WIDE_GBS_PER_SM of its memory bandwidth (memory clock ×
    bus width, double data rate): the H200 (4.8 TB/s on 132 SMs, 36 GB/s) yes, the H100 (3.35 TB/s, 25) and
    consumer cards no. Not CUDA: no."""
    if isinstance(device, torch.device) and device.type != "cuda":
        return False
    props = torch.cuda.get_device_properties(device)
    bandwidth = 2 * getattr(props, "memory_clock_rate", 0) * 1e3 * getattr(props, "memory_bus_width", 0) / 8
    return bandwidth / props.multi_processor_count >= WIDE_GBS_PER_SM * 1e9


_after: dict[int, tuple[weakref.ref, weakref.ref]] = {}  # data_ptr -> (these words, the next GEMV's words)
_latest: list[weakref.ref | None] = [None]
_first: dict[int, tuple[int, int]] = {}  # data_ptr -> (tiles, tiles its launch's first round starts on)


def next_prefetch(kernel: str, words: torch.Tensor, ctas: int, tiles: int, first_tiles: int,
                  conv_lanes: int = 0) -> list:
    """NVRTC GEMV `kernel` (of `KERNELS`) of `words` (`tiles` tiles stored one after another; its `ctas` CTAs
    start on `first_tiles` of them) is about to launch: note it as the next of the one launched before it, and
    return its kernel's last arguments — the next GEMV's words, the bytes to cut at, and runs (stride, bytes,
    count) of 16-byte multiples: the next words' first KB as one run a CTA, or with
    NINFER_NEXT_PREFETCH_SPREAD=1 a share at the start of each tile the next launch starts on — or none where
    prefetching is off for this kernel (off for every kernel: nothing noted either), the GPU older than sm_90,
    or no next GEMV known. `conv_lanes`: the lanes of the GDN conv the GEMV runs in its epilogue (the
    recurrence runs next); above NINFER_NEXT_PREFETCH_CONV_LANES none either (an A/B)."""
    defaults = NEXT_PREFETCH_WIDE if wide_memory(words.device) else NEXT_PREFETCH
    kbs = _by_kernel("NINFER_NEXT_PREFETCH", defaults, "KB", "il=8192:q4il=8192")
    if not any(kbs.values()) or (words.is_cuda and torch.cuda.get_device_capability(words.device)[0] < 9):
        return []  # (nothing learned either: the rounds before a capture teach it once it is on)
    before = _latest[0]() if _latest[0] is not None else None
    if before is not None and before.data_ptr() != words.data_ptr():
        _after[before.data_ptr()] = (weakref.ref(before), weakref.ref(words))
    _latest[0] = weakref.ref(words)
    _first[words.data_ptr()] = (tiles, first_tiles)
    kb = kbs.get(kernel, 0)
    if kb <= 0 or conv_lanes > int(os.environ.get("NINFER_NEXT_PREFETCH_CONV_LANES", MAX_COLUMNS)):
        return []
    these, following = _after.get(words.data_ptr(), (None, None))
    following = following() if these is not None and these() is not None else None
    if following is None or following.device != words.device:
        return []
    total = following.numel() * following.element_size() & ~15
    size = min(kb * 1024, total)
    if size < 16:
        return []
    their_tiles, their_first = _first.get(following.data_ptr(), (0, 0))
    stride = total // their_tiles if their_tiles else 0
    if os.environ.get("NINFER_NEXT_PREFETCH_SPREAD") == "1" and stride and stride % 16 == 0:
        return [following, total, stride, min(stride, _share16(size, their_first)), their_first]
    run = _share16(size, ctas)
    return [following, size, run, run, -(-size // run)]


def _share16(size: int, parts: int) -> int:
    """One of `parts` shares of `size` bytes, rounded up to a 16-byte multiple (a bulk prefetch's unit)."""
    return (-(-size // parts) + 15) & ~15


def with_prefetch(source: str, prefetch: bool) -> str:
    """A GEMV's CUDA source as the NEXT build (`next_prefetch`'s arguments last) or as it is."""
    return "#define NEXT 1\n" + source if prefetch else source


@functools.cache
def _compiled(columns: int, out_kind: int, s: IlSchedule, pdl: bool = False, conv: int = 0,
              evict: int = 0, prefetch: bool = False):
    name = "iq3s_il_mma" if s.kernel == "il_mma" else "iq3s_il_gemv"
    kernel = torch.cuda._compile_kernel(kernel_source(columns, out_kind, s, pdl, conv, evict, prefetch), name)
    kernel.set_shared_memory_config(_smem_optin(torch.device("cuda", torch.cuda.current_device())))
    return kernel


@functools.cache
def _launch_shape(device: torch.device, s: IlSchedule, columns: int, in_features: int) -> int:
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count * _ctas_per_sm(s, columns, in_features, _smem_sm(device),
                                                      props.max_threads_per_multi_processor)


@functools.cache  # gemv_il asks on every call
def tile_ring(s: IlSchedule, columns: int, in_features: int, tiles_a_cta: int, smem_sm: int = 228 * 1024,
              smem_cta: int = 227 * 1024, most: int = _RING) -> int:
    """Tiles a CTA sums at once: its tiles, at most `most`, as many as fit in an SM's shared memory
    (`smem_sm`, a CTA's at most `smem_cta`) beside the CTAs an SM holds with one."""
    per_sm = _ctas_per_sm(s, columns, in_features, smem_sm)
    ring = min(most, tiles_a_cta)
    while ring > 1 and (per_sm * (s.smem_bytes(columns, in_features, ring) + 1024) > smem_sm
                        or s.smem_bytes(columns, in_features, ring) > smem_cta):
        ring -= 1
    return ring


def check_il32(words: torch.Tensor, out_features: int, in_features: int) -> None:
    tiles, pairs = il32_shape(out_features, in_features)
    if in_features % 256 or words.dtype != torch.int32 or words.numel() != tiles * pairs * PAIR_WORDS * 32:
        raise QuantKernelError(f"an il32 iq3_s weight of {out_features}×{in_features} is int32 "
                               f"[{tiles * pairs * PAIR_WORDS * 32}] (repack_il32 of the GGUF rows), got "
                               f"{words.dtype} {list(words.shape)}")


def check_call(kind: str, words: torch.Tensor, xa: QuantizedActivation, group: int) -> None:
    """What every lane-per-row GEMV (il32, q6il) asks of a call before its launch: the activation's grouping,
    the weight on CUDA, 1-8 columns, an output dtype the kernels write."""
    n, k = xa.q.shape
    if xa.d.shape[-1] * group != k:
        raise QuantKernelError(f"the {kind} GEMV takes one activation scale per {group} inputs, got "
                               f"{xa.d.shape[-1]} over {k} (quantize_activation(x, group={group}))")
    if not words.is_cuda:
        raise QuantKernelError(f"the {kind} GEMV is a CUDA kernel; the weight is on {words.device}")
    if not 1 <= n <= MAX_COLUMNS:
        raise QuantKernelError(f"the {kind} GEMV takes 1-{MAX_COLUMNS} columns, got {n}")
    if xa.dtype not in _OUT_KINDS:
        raise QuantKernelError(f"the {kind} GEMV writes float32, bfloat16 or float16, not {xa.dtype}")


# Columns (lanes of one token) up to which the il32 and q4il GEMVs run the GDN decode conv in their epilogue
# (`lane_conv`); NINFER_LANE_CONV_COLUMNS=N for others. Up to 8 against 1 on the H200's graphed rounds: IQ3_S
# −0.06 ms at two lanes, −0.15 at four and eight; Q4_K −0.04 at two, −0.06 at eight; one lane even (gpu-notes
# "Session 50").
LANE_CONV_COLUMNS = 8
# The NVRTC GEMVs (`KERNELS`' names) whose epilogue also runs the conv of spans of several positions a lane
# (a verification round: column m position m % T of lane m / T; `CONV_STAGE`), where the layer ran its conv
# kernel before (session 37, H200: that kernel cost the graphed 4-column IQ3_S step up to 0.23 ms). H100,
# graphed steps, conv kernel → epilogue: session 73 (the first build, re-summing in the store loop)
# IQ3_S 2 columns 6.239 → 6.116 ms, Q4_K 4 columns 6.466 → 6.427, IQ3_S 4 columns 7.417 → 7.432; session 74
# (rebuilt: the outputs read back after a barrier) IQ3_S 2 columns 6.285 → 6.207, Q4_K 4 columns 6.573 →
# 6.568, IQ3_S 4 columns 7.442 → 7.571; session 75 (`conv_span` loading its inputs together) IQ3_S 2 columns
# 6.302 → 6.210, Q4_K 4 columns 6.568 → 6.524, IQ3_S 4 columns 7.424 → 7.460 — so not the tensor-core il32
# kernel (il_mma, 3-8 columns). NINFER_LANE_CONV_SPANS=0 none, =1 all, or names (il,q4il).
LANE_CONV_SPANS: tuple[str, ...] = ("il", "q4il")


def span_kernels() -> tuple[str, ...]:
    """The GEMVs that run a span's conv in their epilogue: `LANE_CONV_SPANS`, or NINFER_LANE_CONV_SPANS's."""
    forced = os.environ.get("NINFER_LANE_CONV_SPANS")
    if forced is None:
        return LANE_CONV_SPANS
    return {"0": (), "1": KERNELS}.get(forced, tuple(k.strip() for k in forced.split(",") if k.strip()))


def lane_conv(conv, x: torch.Tensor, out_features: int, kernel: str):
    """`conv` (a `gdn_decode.ConvEpilogue`) where the il32 or the q4il GEMV `kernel` (`KERNELS`' name) of x is
    to run it in its epilogue (x bf16, a row a position of the conv's lanes, at most `LANE_CONV_COLUMNS` rows,
    several positions a lane only in `span_kernels()`; fp32 slots `[S, C, 3]` and weights `[C, 4]`
    contiguous; the graphed 1-lane round −0.045 ms IQ3_S, −0.058 Q4_K on the H200: gpu-notes "Session 46"),
    else None: the layer runs its conv kernel. NINFER_LANE_CONV=0 turns it off."""
    if conv is None or os.environ.get("NINFER_LANE_CONV") == "0":
        return None
    most = min(MAX_COLUMNS, int(os.environ.get("NINFER_LANE_CONV_COLUMNS", LANE_CONV_COLUMNS)))
    rows = x.numel() // x.shape[-1]
    if (rows != conv.out.shape[0] or rows > most or x.dtype != torch.bfloat16
            or conv.channels > out_features or (conv.positions > 1 and kernel not in span_kernels())):
        return None
    slots, weight, ids = conv.slots, conv.weight, conv.slot_ids
    ok = (slots.dtype == weight.dtype == torch.float32 and slots.stride()[1:] == (3, 1)
          and weight.is_contiguous() and ids.dtype in (torch.int32, torch.int64) and ids.is_contiguous()
          and conv.out.is_contiguous())
    return conv if ok else None


def conv_positions(conv) -> int:
    """A CONV build's positions a lane (`CONV_STAGE`): the conv's, 0 without one."""
    return 0 if conv is None else conv.positions


def conv_arguments(conv) -> list:
    """A CONV build's last arguments (`CONV_STAGE`), the conv marked as run; none without one."""
    if conv is None:
        return []
    conv.applied = True
    return [*conv.launch_args(), conv.slot_ids.element_size() // 4]


def gemv_il(words: torch.Tensor, xa: QuantizedActivation, out_features: int,
            schedule: IlSchedule | None = None, conv=None) -> torch.Tensor:
    """`(q·d) @ Wᵀ -> [n, out_features]` in `xa.dtype`, W the il32 words (CUDA) and xa the int8 activation
    of 1-8 columns; `schedule` (default `il_schedule`) picks the dp4a or the tensor-core kernel; `conv`: a
    GDN decode conv for its epilogue (`lane_conv`'s)."""
    n, k = xa.q.shape
    check_il32(words, out_features, k)
    s = schedule or il_schedule(n, k, out_features)
    check_call("il32", words, xa, s.group)
    tiles = il32_shape(out_features, k)[0]
    ctas = min(tiles, _launch_shape(words.device, s, n, k))
    ring = 1
    if s.splits == 1:
        ring = tile_ring(s, n, k, -(-tiles // ctas), _smem_sm(words.device), _smem_optin(words.device),
                         _RING if s.kernel == "il" else _MMA_RING)
    smem = s.smem_bytes(n, k, ring)
    if smem > _smem_optin(words.device):
        raise QuantKernelError(f"the il32 GEMV of {n} columns over {k} inputs needs {smem} bytes of shared "
                               f"memory, more than this GPU's {_smem_optin(words.device)}; take the GGUF "
                               "layout (NINFER_IQ3S_IL=0)")
    y = torch.empty((n, out_features), dtype=xa.dtype, device=words.device)
    args = [words, xa.words, xa.d, _tables(words.device)[1], y, out_features, k, y.stride(0)]
    pieces = 1
    if s.kernel == "il_mma":
        work = (split_workspace(words.device, s.splits * n * tiles * 32, tiles, slots=True)
                if s.splits > 1 else None)
        if work is None:  # one piece a tile (also while a graph is captured and the workspace is too small)
            args += [1, y, y]
        else:
            args += [s.splits, *work]
            pieces = s.splits
            ctas = min(tiles * s.splits, _launch_shape(words.device, s, n, k))
    following = next_prefetch(s.kernel, words, ctas, tiles, -(-ctas // pieces), n if conv is not None else 0)
    args += [ring, *conv_arguments(conv), *following]
    pdl = pdl_enabled() and os.environ.get("NINFER_IL_PDL", "1") != "0"  # =0: A/B without it
    # one build for every split count
    kernel = _compiled(n, _OUT_KINDS[xa.dtype], s if s.splits == 1 else replace(s, splits=1), pdl,
                       conv_positions(conv), evict=evict_level(s.kernel), prefetch=bool(following))
    _launch(kernel, ctas, 32 * s.warps, smem, args, pdl)
    return y


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_pad", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


@functools.cache
def _driver() -> ctypes.CDLL:
    """The CUDA driver library, as torch's NVRTC launcher loads it (torch 2.11 and 2.13 alike)."""
    return torch.cuda._utils._get_gpu_runtime_library()


def _launch(kernel, ctas: int, threads: int, smem: int, args: list, pdl: bool) -> None:
    """Launch on the current stream; with `pdl` through `cuLaunchKernelEx` with programmatic stream
    serialization (torch's launcher has no launch attributes), so that the kernel may start while the one
    before it finishes (the small kernels ahead of a GEMV let it: `triton_support.pdl_options`)."""
    if not pdl:
        kernel(grid=(ctas, 1, 1), block=(threads, 1, 1), args=args, shared_mem=smem)
        return
    values = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_int(a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
    attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    config = _LaunchConfig((ctas, 1, 1), (threads, 1, 1), smem, torch.cuda.current_stream().cuda_stream,
                           ctypes.pointer(attr), 1)
    rc = _driver().cuLaunchKernelEx(ctypes.byref(config), kernel.func, params, None)
    if rc != 0:
        raise QuantKernelError(f"cuLaunchKernelEx of the il32 GEMV failed with CUresult {rc}; "
                               "NINFER_PDL=0 launches it without programmatic dependent launch")


@jit
def _dequant_il32_kernel(w_ptr, out_ptr, grid_ptr, N, K, P):
    """One 256-weight block of a 32-row tile: program (tile, block) writes out[32 rows, 256 columns]."""
    t = tl.program_id(0)
    blk = tl.program_id(1)
    h = blk % 2
    r = tl.arange(0, 32)[:, None]
    kb = tl.arange(0, 256)[None, :]
    j = kb // 32  # sub-block
    e = (kb % 32) // 4  # grid word in the sub-block
    i = kb % 4  # byte in the grid word
    base = w_ptr + (t * P + blk // 2).to(tl.int64) * (55 * 32) + r
    qs = (tl.load(base + (16 * h + 2 * j + e // 4) * 32) >> (8 * (e % 4))) & 255
    qh = (tl.load(base + (32 + 2 * h + j // 4) * 32) >> (8 * (j % 4) + e)) & 1
    g = tl.load(grid_ptr + (qs | (qh << 8)) * 4 + i).to(tl.float32)
    neg = (tl.load(base + (36 + 8 * h + j) * 32) >> (4 * e + i)) & 1
    sc = (tl.load(base + (52 + h) * 32) >> (4 * j)) & 15
    d = ((tl.load(base + 54 * 32) >> (16 * h)) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    v = d.to(tl.float32) * (1 + 2 * sc).to(tl.float32) * tl.where(neg == 1, -g, g)
    row = t * 32 + r
    col = blk * 256 + kb
    tl.store(out_ptr + row.to(tl.int64) * K + col, v.to(out_ptr.dtype.element_ty), mask=(row < N) & (col < K))


def dequantize_il32(words: torch.Tensor, out_features: int, in_features: int,
                    dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense `[out_features, in_features]` weight in `dtype` from the il32 words (a transient for prefill
    matmuls; into `out` where given): one Triton pass where Triton runs, else unpacked and dequantised by the
    reference."""
    check_il32(words, out_features, in_features)
    if not (HAVE_TRITON and triton_runs_on(words)):
        return dequantize_rows(unpack_il32(words, out_features, in_features), "iq3_s", out_features,
                               in_features, dtype, out)
    out = dense_out(out, out_features, in_features, dtype, words.device)
    tiles, pairs = il32_shape(out_features, in_features)
    _dequant_il32_kernel[(tiles, in_features // 256)](words, out, _tables(words.device)[0], out_features,
                                                      in_features, pairs)
    return out


def il_matmul(words: torch.Tensor, x: torch.Tensor, out_features: int, conv=None) -> torch.Tensor:
    """`x [..., K] @ Wᵀ -> [..., N]` in x's dtype, W the il32 words: the GEMV on up to 8 columns at a
    time through 16, a matmul over the dequantised weight beyond (prefill); `conv`: a GDN decode conv the
    GEMV may run in its epilogue (`lane_conv`; `conv.applied` says whether it did)."""
    in_features = x.shape[-1]
    x2 = x.reshape(-1, in_features)
    if x2.shape[0] > 2 * MAX_COLUMNS:
        per_tile = il32_shape(out_features, in_features)[1] * PAIR_WORDS * 32
        y = matmul_by_rows(x2, out_features, lambda r0, r1, out: dequantize_il32(
            tile_rows(words, per_tile, r0, r1), r1 - r0, in_features, out=out))
        return y.reshape(*x.shape[:-1], out_features)
    n, group = x2.shape[0], il_group()
    xa = quantize_activation_cached(x, group)  # the kernel that made x may have quantised it (`il_group`)
    if n <= MAX_COLUMNS:
        s = il_schedule(n, in_features, out_features, group)
        y = gemv_il(words, xa, out_features, s, conv=lane_conv(conv, x, out_features, s.kernel))
    else:
        y = torch.cat([gemv_il(words, xa.rows(i, i + MAX_COLUMNS), out_features,
                               il_schedule(min(MAX_COLUMNS, n - i), in_features, out_features, group))
                       for i in range(0, n, MAX_COLUMNS)])
    return y.reshape(*x.shape[:-1], out_features)


def il_group() -> int:
    """Inputs per scale of the int8 activation the il32 GEMVs take (`IlSchedule.group`): one scale a block of
    256, as llama.cpp's CPU iq3_s dot product takes its q8_K activation (on the H200 the dp4a kernel 2.5-6 %
    and the tensor-core kernel 8-14 % faster than with 32; gpu-notes "Session 31", "Session 32");
    NINFER_IL_GROUP=32 for one scale per 32. The kernels that make a Linear's input write it so
    (`Linear.activation_group`)."""
    return 32 if os.environ.get("NINFER_IL_GROUP") == "32" else 256


def gemv_il_reference(words: torch.Tensor, xa: QuantizedActivation, out_features: int) -> torch.Tensor:
    """The oracle: the unpacked GGUF rows dequantised, times the dequantised int8 activation, float64."""
    raw = unpack_il32(words, out_features, xa.q.shape[1])
    return gemv_q8_reference(raw, "iq3_s", xa, out_features)
