"""Lane-per-row repacks of the k-quant blocks for the tensor-core decode GEMVs (`gemv_q6il`, `gemv_q4il`).

Per row, a pair of blocks becomes `words` aligned 32-bit words — chosen byte ranges of block 0 then block 1
(`body`), then each block's `tail` (its d, dmin) — and the rows of 32-row tile t are interleaved: word j of
pair p of row r lies at `((t·P + p)·words + j)·32 + r`. A tile's words are contiguous, so the repack, the
unpacking and a prefill matmul run a run of tiles at a time. Rows are padded to 32 and blocks to an even
count with zero blocks (d = 0: they add nothing). The repack is a byte permutation of each pair: lossless,
the same size on whole tiles and pairs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ninfer.kernels.gemv_q8 import QuantizedActivation, quantize_activation_cached
from ninfer.kernels.gguf_matmul import PREFILL_ROWS, QuantKernelError, dequantize_rows, matmul_by_rows

MAX_COLUMNS = 8  # the GEMVs' columns a call


# CUDA C for lane-layout kernels in clusters of CTAs that share a tile (CLUSTER > 1, `__cluster_dims__`;
# q4il's, after `gemv_il.CUDA_HELPERS` and `CONV_STAGE`, with CLUSTER, WARPS, NCOL and CONV defined), each
# CTA rank its share of the blocks: every rank's per-row sums go into rank 0's shared memory (distributed
# shared memory, `mapa`), then one cluster barrier, and rank 0 adds them in rank order and stores the tile
# (`cluster_finish`).
CLUSTER_HELPERS = r"""
#if CLUSTER > 1
#define CLUSTER_DIMS __cluster_dims__(CLUSTER, 1, 1)
// every thread of the cluster's CTAs here before any goes on; their shared-memory stores before it seen after
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// the two halves of a barrier that orders nothing: at the start this thread's arrival, before the first
// store into rank 0 the wait for every thread of the cluster's (so every CTA is running; a whole barrier at
// the start, ahead of the programmatic launch's wait, cost the H200's graphed Q4_K round 0.03 ms)
__device__ __forceinline__ void cluster_arrive() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }
// v into the shared memory of the cluster's CTA rank 0, at the offset of p in this CTA's
__device__ __forceinline__ void st_rank0(float* p, float v) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("mapa.shared::cluster.u32 %0, %0, 0;" : "+r"(a));
    asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(a), "f"(v) : "memory");
}
// `set` (rank 0's, CLUSTER × 256 floats) holds rank r's sum of item i (column i / 32, row i % 32 of the tile)
// at 256 r + i once every rank is past the barrier; rank 0 adds them in rank order and stores. A kernel
// alternates two sets by tile, so a set is written again only after the next tile's barrier, which rank 0
// reaches when done reading it.
__device__ __forceinline__ void cluster_finish(const float* set, int rank, int tile, int N,
                                               out_t* __restrict__ y, int stride_y
#if defined(CONV) && CONV
                                               , const ConvArgs& cv
#endif
                                               ) {
    cluster_sync();
    if (rank != 0) return;
    for (int i = threadIdx.x; i < 32 * NCOL; i += WARPS * 32) {
        const int m = i >> 5, row = i & 31;
        float v = 0.f;
#pragma unroll
        for (int r = 0; r < CLUSTER; ++r) v += set[r * 256 + i];
        if (tile * 32 + row < N) y[m * stride_y + tile * 32 + row] = to_out(v);
#if defined(CONV) && CONV == 1
        if (tile * 32 + row < N) conv_store(cv, m, tile * 32 + row, to_out(v));
#endif
    }
#if defined(CONV) && CONV > 1
    conv_spans(cv, tile, N, y, stride_y);
#endif
}
#else
#define CLUSTER_DIMS
#endif
"""

# CUDA C shared by the lane-layout kernels (after `gemv_il.CUDA_HELPERS`, with WARPS and NCOL defined; where
# CLUSTER > 1 after `CLUSTER_HELPERS`): a 32-row tile's sums, lane 4g + t holding rows 4g..4g + 3 of
# columns 2t, 2t + 1 (`acc[r][e]`) for its warp's share of the tile's blocks, summed over the warps through
# shared memory `red` [WARPS][32 rows][8 columns] and stored to y's rows below N (`store_tile`), or in a
# cluster every rank's sums added by rank 0 (`store_cluster_tile`, `cluster_finish`).
TILE_STORE = r"""
// this warp's sums into red, then the barrier after which every warp's are there
__device__ __forceinline__ void put_tile_sums(float* red, const float (&acc)[4][2], unsigned wid, unsigned gq,
                                              unsigned t) {
    float* rw = red + wid * (32 * 8);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        rw[(4 * gq + r) * 8 + 2 * t] = acc[r][0];
        rw[(4 * gq + r) * 8 + 2 * t + 1] = acc[r][1];
    }
    __syncthreads();
}
// item i (column i / 32, row i % 32 of the tile) summed over the warps
__device__ __forceinline__ float tile_sum(const float* red, int i) {
    float v = 0.f;
#pragma unroll
    for (int s = 0; s < WARPS; ++s) v += red[(s * 32 + (i & 31)) * 8 + (i >> 5)];
    return v;
}
__device__ __forceinline__ void store_tile(float* red, const float (&acc)[4][2], unsigned wid, unsigned gq,
                                           unsigned t, int tile, int N, out_t* __restrict__ y, int stride_y
#if defined(CONV) && CONV
                                           , const ConvArgs& cv
#endif
                                           ) {
    put_tile_sums(red, acc, wid, gq, t);
    for (int i = threadIdx.x; i < 32 * NCOL; i += WARPS * 32) {
        const int m = i >> 5, row = i & 31;
        const float v = tile_sum(red, i);
        if (tile * 32 + row < N) y[m * stride_y + tile * 32 + row] = to_out(v);
#if defined(CONV) && CONV == 1
        if (tile * 32 + row < N) conv_store(cv, m, tile * 32 + row, to_out(v));
#endif
    }
#if defined(CONV) && CONV > 1
    conv_spans(cv, tile, N, y, stride_y);
#endif
    __syncthreads();
}
#if defined(CLUSTER) && CLUSTER > 1
// every rank's sums into rank 0's `set`, then `cluster_finish`, whose barrier also ends every read of `red`
// before the next tile
__device__ __forceinline__ void store_cluster_tile(float* red, float* set, const float (&acc)[4][2],
                                                   unsigned wid, unsigned gq, unsigned t, int rank, int tile,
                                                   int N, out_t* __restrict__ y, int stride_y
#if defined(CONV) && CONV
                                                   , const ConvArgs& cv
#endif
                                                   ) {
    put_tile_sums(red, acc, wid, gq, t);
    for (int i = threadIdx.x; i < 32 * NCOL; i += WARPS * 32)
        st_rank0(set + rank * 256 + i, tile_sum(red, i));
    cluster_finish(set, rank, tile, N, y, stride_y
#if defined(CONV) && CONV
                   , cv
#endif
                   );
}
#endif
"""


def builds(build: Callable[[], object]) -> bool:
    """Whether a lane kernel compiles here (`build`: its NVRTC compile; the il32 kernels' NVRTC check first):
    any failure keeps the GGUF layout."""
    from ninfer.kernels.gemv_il import nvrtc_available

    if not nvrtc_available():
        return False
    try:
        build()
    except Exception:  # noqa: BLE001 - any NVRTC or driver failure means: keep the GGUF layout
        return False
    return True


def tile_rows(words: torch.Tensor, per_tile: int, r0: int, r1: int) -> torch.Tensor:
    """The words of rows r0..r1 (r0 a multiple of 32) of a layout of 32-row tiles, `per_tile` words each."""
    return words[r0 // 32 * per_tile : -(-r1 // 32) * per_tile]


@dataclass(frozen=True)
class LaneLayout:
    format: str
    block_bytes: int
    body: tuple[tuple[int, int], ...]  # byte ranges of a block, block 0's then block 1's
    tail: tuple[int, int]  # each block's bytes after both bodies

    @property
    def words(self) -> int:
        """Words a row and pair of blocks."""
        used = sum(b - a for a, b in self.body) + self.tail[1] - self.tail[0]
        assert used == self.block_bytes and used % 2 == 0
        return used // 2

    def shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        """(32-row tiles, block pairs)."""
        return -(-out_features // 32), -(-(in_features // 256) // 2)

    @functools.cached_property
    def _order(self) -> torch.Tensor:
        """The pair's bytes in word order: indices into block 0's bytes followed by block 1's."""
        b = self.block_bytes
        ranges = [(h * b + a, h * b + e) for h in (0, 1) for a, e in self.body]
        ranges += [(h * b + self.tail[0], h * b + self.tail[1]) for h in (0, 1)]
        return torch.cat([torch.arange(a, e) for a, e in ranges])

    def repack(self, raw: torch.Tensor, chunk_rows: int = PREFILL_ROWS) -> torch.Tensor:
        """GGUF rows `raw` (uint8 `[N, nblk·block_bytes]`) as int32 words `[tiles · pairs · words · 32]` on
        raw's device, `chunk_rows` rows at a time (the transient copies stay small beside the output)."""
        n, row_bytes = raw.shape
        nblk = row_bytes // self.block_bytes
        tiles, pairs = self.shape(n, nblk * 256)
        per_tile, order = pairs * self.words * 32, self._order.to(raw.device)
        out = torch.empty(tiles * per_tile, dtype=torch.int32, device=raw.device)
        step = max(1, chunk_rows // 32)
        for t0 in range(0, tiles, step):
            t1 = min(tiles, t0 + step)
            part = raw[32 * t0 : 32 * t1]
            blocks = torch.zeros(((t1 - t0) * 32, 2 * pairs, self.block_bytes), dtype=torch.uint8,
                                 device=raw.device)
            blocks[: part.shape[0], :nblk] = part.reshape(part.shape[0], nblk, self.block_bytes)
            w = blocks.view(-1, pairs, 2 * self.block_bytes).index_select(-1, order).view(torch.int32)
            w = w.view(-1, 32, pairs, self.words)  # tile, row, pair, word
            out[t0 * per_tile : t1 * per_tile] = w.permute(0, 2, 3, 1).reshape(-1)
        return out

    def unpack(self, words: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
        """The GGUF rows `[out_features, in_features/256 · block_bytes]` back from `repack`'s words."""
        tiles, pairs = self.shape(out_features, in_features)
        w = words.view(tiles, pairs, self.words, 32).permute(0, 3, 1, 2).contiguous()
        pair_bytes = w.view(torch.uint8).view(tiles * 32, pairs, 4 * self.words)
        inverse = torch.argsort(self._order).to(words.device)
        whole = pair_bytes.index_select(-1, inverse).reshape(tiles * 32, 2 * pairs * self.block_bytes)
        return whole[:out_features, : in_features // 256 * self.block_bytes].contiguous()

    def check(self, words: torch.Tensor, out_features: int, in_features: int, name: str) -> None:
        tiles, pairs = self.shape(out_features, in_features)
        size = tiles * pairs * self.words * 32
        if in_features % 256 or words.dtype != torch.int32 or words.numel() != size:
            raise QuantKernelError(f"a {name} {self.format} weight of {out_features}×{in_features} is int32 "
                                   f"[{size}] (repack_{name} of its GGUF rows), got {words.dtype} "
                                   f"[{words.numel()}]")

    def matmul(self, words: torch.Tensor, x: torch.Tensor, out_features: int,
               gemv: Callable[[torch.Tensor, QuantizedActivation, int], torch.Tensor],
               dequantize: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """`x [..., K] @ Wᵀ -> [..., N]` in x's dtype: `gemv` (the activation per 256) on up to 8 columns at a
        time through 16; beyond (prefill), a dense matmul over `PREFILL_ROWS` rows at a time dequantised by
        `dequantize` (words, rows, K, out=piece), or unpacked to GGUF rows and dequantised without one."""
        in_features = x.shape[-1]
        x2 = x.reshape(-1, in_features)
        n = x2.shape[0]
        if n > 2 * MAX_COLUMNS:
            per_tile = self.shape(out_features, in_features)[1] * self.words * 32

            def dense(r0: int, r1: int, out: torch.Tensor) -> torch.Tensor:
                part = tile_rows(words, per_tile, r0, r1)
                if dequantize is None:
                    return dequantize_rows(self.unpack(part, r1 - r0, in_features), self.format, r1 - r0,
                                           in_features, out=out)
                return dequantize(part, r1 - r0, in_features, out=out)

            return matmul_by_rows(x2, out_features, dense).reshape(*x.shape[:-1], out_features)
        xa = quantize_activation_cached(x, 256)
        if n <= MAX_COLUMNS:  # the GEMV's own output: a copy would be a graph node between it and its reader
            y = gemv(words, xa, out_features)
        else:
            y = torch.cat([gemv(words, xa.rows(i, i + MAX_COLUMNS), out_features)
                           for i in range(0, n, MAX_COLUMNS)])
        return y.reshape(*x.shape[:-1], out_features)
