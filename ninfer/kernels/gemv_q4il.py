"""q4_k decode GEMV on int8 tensor cores over a lane-per-row repack ("q4il"), CUDA C compiled by NVRTC, routed
for the q4_k matrices of ≥ 5120 rows (`q4il_wanted`); prefill decodes the words to bf16 in one Triton pass
(`dequantize_q4il`).

Why: the GGUF routes' 2–8-column q4_k GEMVs ran at 35–60 % of DRAM bandwidth (rows and fragment kernels) where
one column reaches ~85 %. Here each weight is decoded once into an mma fragment and every column is an operand
of the same instruction: on an H200 the 27B's gate|up takes 29.0 / 30.8 / 35.1 µs at 1 / 4 / 8 columns where
the GGUF routes take 29.2 / 45.7 / 56.6 (bench/q4il_timing.py, session 35 run 5).

Layout (`LAYOUT`, `lane_layout.LaneLayout`): per row and pair of 144-byte blocks, 72 words — block 0's qs (32
words) and scales (3), block 1's, then each block's d | dmin << 16; 32 rows interleaved. Lane 4g + t of a warp
owns rows 4g..4g + 3 (one 16-byte load of a word serves all four).

A 64-input pair of sub-blocks i of a block (qs bytes 32i..32i + 31: sub-block 2i in the low nibbles, 2i + 1 in
the high ones): lane t takes qs words 8i + 2t and 8i + 2t + 1 (inputs 8t..8t + 7 of either sub-block) as the
k slots 4t..4t + 3 and 16 + 4t..16 + 4t + 3 of an `mma.m16n8k32.u8.s8` (the activation words at the same
inputs as its B operand: a permutation of k that A and B share), the low nibbles `& 0x0F0F0F0F`, the high ones
`& 0xF0F0F0F0` (16 × the value: no shift); per row and column the integer sums 16·Σ sc·dot of the low and Σ
sc·dot of the high sub-blocks, sc the 6-bit scale by a prmt. The min term Σ_j m_j·Σx_j takes four dp4a: the
activation's producer wrote its per-32 sums split as 64·hi + lo (both int8, `QuantizedActivation.s` at group
256; each CTA summed them itself until session 60, ~0.1 ms of a graphed 1-lane Q4_K round and 1.2 ms of an
8-lane one on an H100), and the packed 6-bit mins are dp4a operands as they are. One float expression a
block: `xd·(d/16·isum − dmin·msum)` (activation per 256). A CTA takes whole tiles; its warps share a tile's
blocks and add their sums through shared memory. Cutting tiles across CTAs (a fixed split, or stream-K runs
over the last rounds' tiles) was slower at every 27B shape (session 35): each cut piece waits on an atomic and
its fixup's reads.
"""

from __future__ import annotations

import functools
import os

import torch

from ninfer.kernels.gemv_il import (
    _OUT_KINDS,
    CONV_STAGE,
    CUDA_HELPERS,
    _launch,
    _smem_optin,
    check_call,
    conv_arguments,
    conv_positions,
    evict_level,
    lane_conv,
    next_prefetch,
    wide_memory,
    with_prefetch,
)
from ninfer.kernels.gemv_q8 import QuantizedActivation, gemv_q8_reference, quantize_activation_cached
from ninfer.kernels.gguf_matmul import QuantKernelError, dense_out, dequantize_rows
from ninfer.kernels.lane_layout import CLUSTER_HELPERS, TILE_STORE, LaneLayout, builds
from ninfer.kernels.triton_support import HAVE_TRITON, jit, pdl_enabled, tl, triton_runs_on

LAYOUT = LaneLayout("q4_k", 144, body=((16, 144), (4, 16)), tail=(0, 4))  # qs, scales; then d, dmin
PAIR_WORDS = LAYOUT.words  # 72
# (warps a CTA, CTAs an SM): the launch bounds, each at most 128 registers a thread; `q4il_shape` picks one
SHAPES = ((8, 2), (5, 3), (4, 4))
# q4il_wanted: every q4_k matrix of the 27B (its 5120-row projections' 160 tiles fill 0.6 of the H200's CTA
# slots at 8 warps × 2; the suite's 1-column step is even with them on the GGUF routes, session 36)
MIN_ROWS = 5120


def repack_q4il(raw: torch.Tensor, chunk_rows: int = 8192) -> torch.Tensor:
    """q4_k rows `raw` (uint8 `[N, nblk·144]`) as the layout's int32 words `[tiles · pairs · 72 · 32]`."""
    return LAYOUT.repack(raw, chunk_rows)


def unpack_q4il(words: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The GGUF rows `[out_features, in_features/256 · 144]` back from `repack_q4il`'s words."""
    return LAYOUT.unpack(words, out_features, in_features)


# Asynchronous 16-byte copies global -> shared (cp.async, cached in L2 only) for the staged build
# (STAGES): a warp's next weights land in shared memory while it works on the current ones, in no
# register (tests/cuda_cpu.py lands them only at the copying lane's wait).
ASYNC_COPY = r"""
#if STAGES
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) {
#if EVICT == 2
    const unsigned long long pol = evict_first();  // the weights evict-first in L2, as ldw's
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;"
                 :: "r"(dst), "l"(src), "l"(pol) : "memory");
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// every group but the STAGES - 1 newest landed (this lane's copies)
__device__ __forceinline__ void cp_async_wait_stages() {
    asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 1) : "memory");
}
#endif
"""

_SOURCE = r"""
#define OUT_KIND __OUT_KIND__
#define NCOL __NCOL__
#define WARPS __WARPS__
#define CTAS __CTAS__
#define PDL __PDL__
#define CONV __CONV__
#define STAGES __STAGES__
#define CLUSTER __CLUSTER__
#define EVICT __EVICT__
""" + CUDA_HELPERS + CONV_STAGE + CLUSTER_HELPERS + TILE_STORE + ASYNC_COPY + r"""
#if STAGES
#define WLD(p) (*(p))  // a weight word from the warp's slot in shared memory
#else
#define WLD(p) ldw4(p)
#endif
#if STAGES
// STAGES 2: each warp copies its next block into one of its two slots in shared memory (cp.async) while it
// works on the other: a block's 35 lines from word 35h (its qs and scales, in one run) and its d | dmin line
// (70 + h), 128 bytes a line of the tile's 32 rows, 288 16-byte chunks, chunk c at byte 16c of the slot.
#define SLOT_CHUNKS 288
// the warp's blocks in the order it works on them: block kb of tile `tile` (kb = wid, += WARPS below nblk;
// tiles blockIdx.x, += gridDim.x; tile == tiles: none left)
struct QBlock { int tile, kb; };
__device__ __forceinline__ QBlock next_qblock(QBlock b, int tiles, int nblk) {
    b.kb += WARPS;
    if (b.kb >= nblk) b = QBlock{b.tile + (int)gridDim.x, (int)(threadIdx.x >> 5)};
    return b.kb < nblk && b.tile < tiles ? b : QBlock{tiles, 0};
}
// this lane's copies of block b into the slot at shared address `slot` (chunks lane, lane + 32, ...)
__device__ __forceinline__ void stage_qblock(QBlock b, int tiles, int P, const uint4* __restrict__ w,
                                             unsigned slot, unsigned lane) {
    if (b.tile >= tiles) return;
    const int h = b.kb & 1;
    const uint4* pair = w + (size_t)(b.tile * P + (b.kb >> 1)) * (72 * 8);
#pragma unroll
    for (int q = 0; q < SLOT_CHUNKS / 32; ++q) {
        const int c = lane + 32 * q;
        cp_async16(slot + 16 * c, c < 280 ? pair + 8 * 35 * h + c : pair + 8 * (70 + h) + (c - 280));
    }
}
#endif
__device__ __forceinline__ unsigned part(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
__device__ __forceinline__ int field(const int4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
// c += a (16 rows × 32 unsigned bytes) · b (32 signed bytes × 8 columns), int32
__device__ __forceinline__ void mma_u8s8(int (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         int b0, int b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, CTAS) CLUSTER_DIMS
q4k_il_mma(const uint4* __restrict__ w, const int* __restrict__ xw, const float* __restrict__ xd,
           const int4* __restrict__ xsum, out_t* __restrict__ y, int N, int K, int stride_y CONV_PARAMS
           NEXT_PARAMS)
{
    CONV_ARGS
    // CTA c takes tiles c, c + gridDim.x, ..., its warps a tile's blocks wid, wid + WARPS, ...; in clusters
    // (CLUSTER > 1) cluster c = blockIdx.x / CLUSTER the tiles c, c + gridDim.x / CLUSTER, ..., and warp
    // wid of its CTA rank r the blocks r·WARPS + wid, + CLUSTER·WARPS, ...
    // xsum: per column and block the activation's sums over each 32 inputs as its producer wrote them
    // (`QuantizedActivation.s` at group 256), bytes {hi j0..7, lo j0..7}, Σ = 64 hi + lo (int8 both)
    extern __shared__ float4 smem[];
    const int K4 = K >> 2, nblk = K >> 8, P = (nblk + 1) >> 1, tiles = (N + 31) >> 5;
    float* red = reinterpret_cast<float*>(smem);  // [WARPS][32 rows][8 columns] partial sums
#if STAGES
    // the warp's two slots after the sums; its first block asked for before the wait (weights are not the
    // previous kernel's output)
    const char* slots = reinterpret_cast<const char*>(red + WARPS * 32 * 8)
                        + (threadIdx.x >> 5) * (2 * 16 * SLOT_CHUNKS);
    const unsigned slot0 = (unsigned)__cvta_generic_to_shared(slots);
    QBlock ahead = QBlock{(int)threadIdx.x >> 5 < nblk ? (int)blockIdx.x : tiles, (int)threadIdx.x >> 5};
    stage_qblock(ahead, tiles, P, w, slot0, threadIdx.x & 31);
    cp_async_commit();
    int n = 0;  // the warp's blocks so far: block n sits in slot n % 2
#endif
#if CLUSTER > 1
    const int rank = (int)blockIdx.x % CLUSTER;
    cluster_arrive();  // (its wait before the first tile's store: every CTA of the cluster running)
#endif
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");  // the activation is the previous kernel's output
#endif
    const unsigned lane = threadIdx.x & 31, wid = threadIdx.x >> 5, gq = lane >> 2, t = lane & 3;
    const int* xl = xw + min((int)gq, NCOL - 1) * K4 + 2 * t;  // B words of inputs 8t.. of a 32: xl[i / 4]
    const int c0 = min(2 * (int)t, NCOL - 1), c1 = min(2 * (int)t + 1, NCOL - 1);
    const float* xd0 = xd + c0 * nblk;
    const float* xd1 = xd + c1 * nblk;
    const int4* xsum0 = xsum + c0 * nblk;
    const int4* xsum1 = xsum + c1 * nblk;
#if CLUSTER > 1
    float* sums = red + WARPS * 32 * 8;
    int it = 0;  // this CTA's tiles so far
    for (int tile = blockIdx.x / CLUSTER; tile < tiles; tile += gridDim.x / CLUSTER, ++it) {
        float acc[4][2];
#pragma unroll
        for (int r = 0; r < 4; ++r) { acc[r][0] = 0.f; acc[r][1] = 0.f; }
        for (int kb = rank * WARPS + wid; kb < nblk; kb += CLUSTER * WARPS) {
#else
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        float acc[4][2];
#pragma unroll
        for (int r = 0; r < 4; ++r) { acc[r][0] = 0.f; acc[r][1] = 0.f; }
        for (int kb = wid; kb < nblk; kb += WARPS) {
#endif
#if STAGES
            // the next block into the other slot (read by every lane before the barrier that ended the last
            // block), then this one landed and seen by the whole warp
            ahead = next_qblock(ahead, tiles, nblk);
            stage_qblock(ahead, tiles, P, w, slot0 + ((n + 1) & 1) * (16 * SLOT_CHUNKS), lane);
            cp_async_commit();
            cp_async_wait_stages();
            __syncwarp();
            const uint4* blk = reinterpret_cast<const uint4*>(slots + (n & 1) * (16 * SLOT_CHUNKS)) + gq;
            const uint4 dd = blk[8 * 35];
#else
            const int h = kb & 1;
            const uint4* wb = w + (size_t)(tile * P + (kb >> 1)) * (72 * 8) + gq;  // word j at wb[8 j]
            const uint4* blk = wb + 8 * 35 * h;
            // with the block's other loads: one DRAM round trip a block
            const uint4 dd = ldw4(wb + 8 * (70 + h));
#endif
            const uint4 s0 = WLD(blk + 8 * 32), s1 = WLD(blk + 8 * 33), s2 = WLD(blk + 8 * 34);
            const float x0 = __ldg(xd0 + kb), x1 = __ldg(xd1 + kb);
            // 6-bit scales of sub-blocks 0..3 / 4..7, a byte each
            unsigned sl[4], sh[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                sl[r] = part(s0, r) & 0x3F3F3F3Fu;
                sh[r] = (part(s2, r) & 0x0F0F0F0Fu) | ((part(s0, r) >> 2) & 0x30303030u);
            }
            // 16 Σ sc·dot of the low-nibble sub-blocks, Σ sc·(16 dot) of the high ones
            int ilo[4][2] = {{0, 0}, {0, 0}, {0, 0}, {0, 0}}, ihi[4][2] = {{0, 0}, {0, 0}, {0, 0}, {0, 0}};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const uint4 qa = WLD(blk + 8 * (8 * i + 2 * t)), qb = WLD(blk + 8 * (8 * i + 2 * t + 1));
                const int2 xlo = __ldg(reinterpret_cast<const int2*>(xl + kb * 64 + 16 * i));
                const int2 xhi = __ldg(reinterpret_cast<const int2*>(xl + kb * 64 + 16 * i + 8));
                int cl0[4] = {0, 0, 0, 0}, cl1[4] = {0, 0, 0, 0};
                int ch0[4] = {0, 0, 0, 0}, ch1[4] = {0, 0, 0, 0};
                // rows 4g, 4g + 1 as mma rows g, g + 8; rows 4g + 2, 4g + 3 in the second mma
                mma_u8s8(cl0, part(qa, 0) & 0x0F0F0F0Fu, part(qa, 1) & 0x0F0F0F0Fu, part(qb, 0) & 0x0F0F0F0Fu,
                         part(qb, 1) & 0x0F0F0F0Fu, xlo.x, xlo.y);
                mma_u8s8(cl1, part(qa, 2) & 0x0F0F0F0Fu, part(qa, 3) & 0x0F0F0F0Fu, part(qb, 2) & 0x0F0F0F0Fu,
                         part(qb, 3) & 0x0F0F0F0Fu, xlo.x, xlo.y);
                mma_u8s8(ch0, part(qa, 0) & 0xF0F0F0F0u, part(qa, 1) & 0xF0F0F0F0u, part(qb, 0) & 0xF0F0F0F0u,
                         part(qb, 1) & 0xF0F0F0F0u, xhi.x, xhi.y);
                mma_u8s8(ch1, part(qa, 2) & 0xF0F0F0F0u, part(qa, 3) & 0xF0F0F0F0u, part(qb, 2) & 0xF0F0F0F0u,
                         part(qb, 3) & 0xF0F0F0F0u, xhi.x, xhi.y);
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    // the scales of sub-blocks 2i (low nibbles) and 2i + 1: bytes 2i & 3, 2i + 1 & 3
                    const unsigned word = i < 2 ? sl[r] : sh[r];
                    const int ls = (int)prmt(word, 0, 0x4440u + ((2 * i) & 3));
                    const int hs = (int)prmt(word, 0, 0x4440u + ((2 * i + 1) & 3));
                    const int* cl = r < 2 ? cl0 : cl1;
                    const int* ch = r < 2 ? ch0 : ch1;
                    ilo[r][0] += cl[2 * (r & 1)] * ls;
                    ihi[r][0] += ch[2 * (r & 1)] * hs;
                    if (NCOL > 1) {
                        ilo[r][1] += cl[2 * (r & 1) + 1] * ls;
                        ihi[r][1] += ch[2 * (r & 1) + 1] * hs;
                    }
                }
            }
            const int4 xs0 = __ldg(xsum0 + kb), xs1 = __ldg(xsum1 + kb);
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                // 6-bit mins of sub-blocks 0..3 / 4..7, a byte each: Σ m_j·(64 hi_j + lo_j) by four dp4a
                const unsigned ml = part(s1, r) & 0x3F3F3F3Fu;
                const unsigned mh = ((part(s2, r) >> 4) & 0x0F0F0F0Fu) | ((part(s1, r) >> 2) & 0x30303030u);
                const float d = f16_lo(part(dd, r)) * 0.0625f, dmin = f16_hi(part(dd, r));
#pragma unroll
                for (int e = 0; e < (NCOL > 1 ? 2 : 1); ++e) {
                    const int4& v = e ? xs1 : xs0;
                    const int msum = 64 * dp4a(mh, field(v, 1), dp4a(ml, field(v, 0), 0))
                                     + dp4a(mh, field(v, 3), dp4a(ml, field(v, 2), 0));
                    const float isum = (float)(16 * ilo[r][e] + ihi[r][e]);
                    acc[r][e] = fmaf(fmaf(d, isum, -dmin * (float)msum), e ? x1 : x0, acc[r][e]);
                }
            }
#if STAGES
            __syncwarp();  // every lane done with slot n % 2: the block after next may land there
            ++n;
#endif
        }
#if CLUSTER > 1
#if PDL
        if (tile + gridDim.x / CLUSTER >= tiles) asm volatile("griddepcontrol.launch_dependents;");
#endif
        NEXT_PREFETCH(tile + gridDim.x / CLUSTER >= tiles)
        if (it == 0) cluster_wait();
        store_cluster_tile(red, sums + (it & 1) * (CLUSTER * 256), acc, wid, gq, t, rank, tile, N, y, stride_y
#if CONV
                           , cv
#endif
                           );
#else
#if PDL
        if (tile + gridDim.x >= tiles) asm volatile("griddepcontrol.launch_dependents;");
#endif
        NEXT_PREFETCH(tile + gridDim.x >= tiles)
        store_tile(red, acc, wid, gq, t, tile, N, y, stride_y
#if CONV
                   , cv
#endif
                   );
#endif
    }
}
"""


def kernel_source(columns: int, out_kind: int, pdl: bool = False, shape: tuple[int, int] = SHAPES[0],
                  conv: int = 0, staged: bool = False, cluster: int = 1, evict: int = 0,
                  prefetch: bool = False) -> str:
    """`conv` (bf16 out): the GDN decode conv in the epilogue, its positions a lane (`gemv_il.CONV_STAGE`,
    `gemv_il.lane_conv`; 0 none).
    `staged`: each warp's next block copied into shared memory while it works on one (the STAGES build).
    `cluster` > 1: clusters of that many CTAs share each tile (`lane_layout.CLUSTER_HELPERS`; not staged).
    `evict`: the weight loads' and copies' cache hints (`gemv_il.evict_level`). `prefetch`: the next GEMV's
    first weight bytes asked into L2 at the end (`gemv_il.next_prefetch`)."""
    if conv and out_kind != _OUT_KINDS[torch.bfloat16]:
        raise QuantKernelError("the q4il conv builds write bf16")
    if cluster > 1 and staged:
        raise QuantKernelError("the q4il cluster builds are not staged")
    warps, ctas = shape
    return (with_prefetch(_SOURCE, prefetch).replace("__OUT_KIND__", str(out_kind))
            .replace("__NCOL__", str(columns))
            .replace("__CONV__", str(int(conv))).replace("__STAGES__", "2" if staged else "0")
            .replace("__WARPS__", str(warps)).replace("__CTAS__", str(ctas))
            .replace("__PDL__", str(int(pdl))).replace("__CLUSTER__", str(cluster))
            .replace("__EVICT__", str(evict)))


def smem_bytes(warps: int, staged: bool = False, cluster: int = 1) -> int:
    """The warps' partial sums; staged, each warp's two slots of a block (2 × 4.5 KB); in clusters, two sets
    of every rank's sums of a tile (rank 0's)."""
    return (warps * 32 * 8 * 4 + (warps * 2 * 288 * 16 if staged else 0)
            + (2 * cluster * 256 * 4 if cluster > 1 else 0))


def q4il_shape(tiles: int, sms: int) -> tuple[int, int]:
    """The (warps, CTAs an SM) of `SHAPES` whose grid leaves the least of its last round of tiles idle, the
    most CTAs on a tie. H200 (132 SMs, bench/q4il_timing.py, session 35 run 5, µs at 1 / 4 columns): the
    27B's gate|up (1088 tiles: 4.12 rounds of 264 CTAs, 2.75 of 396) 31.8 / 33.5 at 8 × 2, 29.0 / 30.8 at
    5 × 3; its GDN input (515 tiles: 0.98 rounds of 528) 16.1 / 17.3 at 8 × 2, 15.1 / 16.9 at 4 × 4.
    NINFER_Q4IL_SHAPE=WxC (for A/B): that shape for the matrices of fewer tiles than any shape's CTA slots
    (the 27B's 5120-row projections)."""
    def key(shape: tuple[int, int]) -> tuple[float, int]:
        slots = shape[1] * sms
        return tiles / (-(-tiles // slots) * slots), shape[1]

    forced = os.environ.get("NINFER_Q4IL_SHAPE", "")
    if forced and tiles < min(s[1] for s in SHAPES) * sms:
        shape = tuple(int(v) for v in forced.split("x"))
        if shape not in SHAPES:
            raise QuantKernelError(f"NINFER_Q4IL_SHAPE={forced}: one of " + ", ".join(
                f"{w}x{c}" for w, c in SHAPES))
        return shape
    return max(SHAPES, key=key)


# Columns up to which q4il stages its blocks by default: the 27B Q4_K graphed rounds on the H200 −0.03 ms at
# one lane, −0.10 at two and at one lane of 4 positions, −0.08 at four lanes, +0.03 at eight (gpu-notes
# "Session 50", when every CTA still summed the activation after its wait); with the producers' sums, eight
# lanes on their own slots −0.17 ms and the rest even (H100, session 61).
STAGED_COLUMNS = 8


def q4il_staged(columns: int) -> bool:
    """Whether a call of `columns` takes the staged build by default: at most `STAGED_COLUMNS` columns;
    NINFER_Q4IL_STAGED=0 / 1 never / always. Staged only where the tiles fill the CTA slots (not the 27B's
    5120-row matrices, which lose 0.1-0.6 µs a call from it alone) was slower still: the graphed Q4_K rounds
    +0.07-0.10 ms at 1-4 lanes and 4 columns on an H100 (gpu-notes "Session 51")."""
    forced = os.environ.get("NINFER_Q4IL_STAGED", "")
    if forced in ("0", "1"):
        return forced == "1"
    return columns <= STAGED_COLUMNS


# Clusters of CTAs a tile by default: CLUSTER CTAs at up to CLUSTER_COLUMNS columns where an SM's share of the
# HBM is at least `gemv_il.WIDE_GBS_PER_SM` (`gemv_il.wide_memory`). The graphed Q4_K rounds of the 27B with
# clusters of 2 on its 5120-row projections (gpu-notes "Session 51"): H200 (4.8 TB/s on 132 SMs, 36 GB/s an
# SM) 1 / 2 lanes 5.375 / 5.636 → 5.281 / 5.552 ms, down alone 18.9 → 16.5 µs at one column; H100 (3.35 TB/s,
# 25 GB/s an SM) 6.560 / 6.736 → 6.687 / 6.897, down alone even (21.8).
CLUSTER = 2
CLUSTER_COLUMNS = 2


@functools.cache
def clusters_pay(device: torch.device) -> bool:
    """Whether `device` takes the default clusters: thread-block clusters (compute capability 9+) and an SM's
    share of the memory bandwidth at least `gemv_il.WIDE_GBS_PER_SM` (`gemv_il.wide_memory`)."""
    return getattr(torch.cuda.get_device_properties(device), "major", 0) >= 9 and wide_memory(device)


def q4il_cluster(tiles: int, sms: int, shape: tuple[int, int], columns: int,
                 pays: bool) -> tuple[tuple[int, int], int]:
    """The (CTA shape, cluster) of a call of `columns` over `tiles` whose default shape is `shape`, on a
    device where clusters pay (`clusters_pay`) or not: clusters of CLUSTER CTAs a tile at up to
    CLUSTER_COLUMNS columns where they pay (NINFER_Q4IL_CLUSTER=N: of N at every width, 1 none), only for
    matrices whose tiles leave `shape`'s CTA slots idle (the 27B's 5120-row projections: 160 tiles on the
    H200's 264), at the shape of the most warps a CTA whose slots hold every CTA at once."""
    wanted = os.environ.get("NINFER_Q4IL_CLUSTER", "")
    if wanted.isdigit():
        cluster = int(wanted)
    else:
        cluster = CLUSTER if pays and columns <= CLUSTER_COLUMNS else 1
    if cluster <= 1 or tiles >= shape[1] * sms:
        return shape, 1
    fits = [s for s in SHAPES if tiles * cluster <= s[1] * sms]
    return (max(fits), cluster) if fits else (shape, 1)


@functools.cache
def _compiled(columns: int, out_kind: int, pdl: bool, shape: tuple[int, int], conv: int = 0,
              staged: bool = False, cluster: int = 1, evict: int = 0, prefetch: bool = False):
    kernel = torch.cuda._compile_kernel(kernel_source(columns, out_kind, pdl, shape, conv, staged, cluster,
                                                      evict, prefetch), "q4k_il_mma")
    kernel.set_shared_memory_config(_smem_optin(torch.device("cuda", torch.cuda.current_device())))
    return kernel


def gemv_q4il(words: torch.Tensor, xa: QuantizedActivation, out_features: int,
              shape: tuple[int, int] | None = None, conv=None, staged: bool | None = None,
              cluster: int | None = None) -> torch.Tensor:
    """`(q·d) @ Wᵀ -> [n, out_features]` in `xa.dtype`, W the q4il words (CUDA) and xa the int8 activation of
    1-8 columns with one scale per 256 inputs; `shape` (warps, CTAs an SM) and `cluster` (CTAs sharing a
    tile) default to `q4il_shape`'s and `q4il_cluster`'s; `conv`: a GDN decode conv for its epilogue
    (`gemv_il.lane_conv`'s); `staged`: each warp's next block copied into shared memory (cp.async) while it
    works on one, the first before the programmatic launch's wait (gpu-notes "Session 48"); by default as
    `q4il_staged` says, never in clusters."""
    n, k = xa.q.shape
    LAYOUT.check(words, out_features, k, "q4il")
    check_call("q4il", words, xa, 256)
    if xa.s.dtype != torch.int8 or xa.s.shape != (n, k // 16) or not xa.s.is_contiguous():
        raise QuantKernelError(f"the q4il GEMV reads each 32 inputs' sums as int8 [{n}, {k // 16}] (the "
                               f"activation's s at group 256), got {xa.s.dtype} {list(xa.s.shape)}")
    tiles = LAYOUT.shape(out_features, k)[0]
    sms = torch.cuda.get_device_properties(words.device).multi_processor_count
    if cluster is None:
        pays = clusters_pay(words.device)
        shape, cluster = (shape, 1) if shape else q4il_cluster(tiles, sms, q4il_shape(tiles, sms), n, pays)
    shape = shape or q4il_shape(tiles, sms)
    if staged is None:
        staged = cluster == 1 and q4il_staged(n)
    y = torch.empty((n, out_features), dtype=xa.dtype, device=words.device)
    pdl = pdl_enabled()
    ctas = cluster * min(tiles, shape[1] * sms // cluster)
    following = next_prefetch("q4il", words, ctas, tiles, ctas // cluster, n if conv is not None else 0)
    kernel = _compiled(n, _OUT_KINDS[xa.dtype], pdl, shape, conv_positions(conv), staged, cluster,
                       evict=evict_level("q4il"), prefetch=bool(following))
    _launch(kernel, ctas, 32 * shape[0], smem_bytes(shape[0], staged, cluster),
            [words, xa.words, xa.d, xa.s, y, out_features, k, y.stride(0), *conv_arguments(conv), *following],
            pdl)
    return y


def q4il_wanted(format: str, out_features: int, in_features: int, device: torch.device | str) -> bool:
    """Whether a resident weight takes the q4il layout: the q4_k matrices of ≥ `MIN_ROWS` rows on CUDA where
    the kernel compiles (NINFER_Q4K_IL=0: none, =N: those of ≥ N rows, so 1 takes every q4_k matrix). The
    27B's 5120-row projections lose 0.4-0.6 µs a call alone at one column (18.4 against 18.0 µs, 8.2 against
    7.6) and win 10-25 % at 2-4 columns: the suite's 1-column step is even, the 4-column one 0.3 ms faster
    (gpu-notes "Session 36"); fewer rows leave more CTA slots idle."""
    if format.removeprefix("gguf_") != "q4_k" or torch.device(device).type != "cuda" or in_features % 256:
        return False
    wanted = os.environ.get("NINFER_Q4K_IL", "")
    min_rows = int(wanted) if wanted.isdigit() else MIN_ROWS
    if min_rows == 0 or out_features < min_rows:
        return False
    return _compiles()


@functools.cache
def _compiles() -> bool:
    return builds(lambda: _compiled(1, _OUT_KINDS[torch.bfloat16], False, SHAPES[0]))


@jit
def _dequant_q4il_kernel(w_ptr, out_ptr, N, K, P):
    """One 256-weight block of a 32-row tile: program (tile, block) writes out[32 rows, 256 columns]."""
    t = tl.program_id(0)
    blk = tl.program_id(1)
    h = blk % 2
    r = tl.arange(0, 32)[:, None]
    kb = tl.arange(0, 256)[None, :]
    s = kb // 32  # sub-block: the low nibbles of qs bytes 32·(s // 2).. when s is even, else the high ones
    q = 32 * (s // 2) + kb % 32
    base = w_ptr + (t * P + blk // 2).to(tl.int64) * (72 * 32) + r  # word j of the pair at base[32 j]
    nib = ((tl.load(base + (35 * h + q // 4) * 32) >> (8 * (q % 4) + 4 * (s % 2))) & 15).to(tl.float32)
    j = s % 4  # the 12 scale bytes: a = byte j, b = byte j + 4, c = byte j + 8
    a = (tl.load(base + (35 * h + 32) * 32) >> (8 * j)) & 255
    b = (tl.load(base + (35 * h + 33) * 32) >> (8 * j)) & 255
    c = (tl.load(base + (35 * h + 34) * 32) >> (8 * j)) & 255
    sc = tl.where(s < 4, a & 63, (c & 15) | ((a >> 6) << 4)).to(tl.float32)
    mn = tl.where(s < 4, b & 63, (c >> 4) | ((b >> 6) << 4)).to(tl.float32)
    dd = tl.load(base + (70 + h) * 32)
    d = (dd & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((dd >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    v = (d * sc) * nib - dmin * mn
    row = t * 32 + r
    col = blk * 256 + kb
    tl.store(out_ptr + row.to(tl.int64) * K + col, v.to(out_ptr.dtype.element_ty), mask=(row < N) & (col < K))


def dequantize_q4il(words: torch.Tensor, out_features: int, in_features: int,
                    dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense `[out_features, in_features]` weight in `dtype` from the q4il words (a transient for prefill
    matmuls; into `out` where given): one Triton pass where Triton runs, else unpacked and dequantised by the
    reference."""
    LAYOUT.check(words, out_features, in_features, "q4il")
    if not (HAVE_TRITON and triton_runs_on(words)):
        return dequantize_rows(unpack_q4il(words, out_features, in_features), "q4_k", out_features,
                               in_features, dtype, out)
    out = dense_out(out, out_features, in_features, dtype, words.device)
    tiles, pairs = LAYOUT.shape(out_features, in_features)
    _dequant_q4il_kernel[(tiles, in_features // 256)](words, out, out_features, in_features, pairs)
    return out


def q4il_matmul(words: torch.Tensor, x: torch.Tensor, out_features: int, conv=None) -> torch.Tensor:
    """`x [..., K] @ Wᵀ -> [..., N]` in x's dtype, W the q4il words (`LaneLayout.matmul`; prefill over
    `dequantize_q4il`'s rows); `conv`: `gemv_il.il_matmul`'s."""
    conv = lane_conv(conv, x, out_features, "q4il")
    if conv is not None:  # 1-8 columns
        y = gemv_q4il(words, quantize_activation_cached(x, 256), out_features, conv=conv)
        return y.reshape(*x.shape[:-1], out_features)
    return LAYOUT.matmul(words, x, out_features, gemv_q4il, dequantize_q4il)


def gemv_q4il_reference(words: torch.Tensor, xa: QuantizedActivation, out_features: int) -> torch.Tensor:
    """The oracle: the unpacked GGUF rows dequantised, times the dequantised int8 activation, float64."""
    return gemv_q8_reference(unpack_q4il(words, out_features, xa.q.shape[1]), "q4_k", xa, out_features)
