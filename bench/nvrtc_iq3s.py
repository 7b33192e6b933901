"""Experiment (session 8): the iq3_s decode GEMV in CUDA C, compiled at run time by NVRTC through
`torch.cuda._compile_kernel`, with the grid in shared memory, to test whether the Triton rows kernel
(`ninfer/kernels/gemv_rows_iq.py`, 25.5 µs on 17408×5120 against a ~11 µs weight-streaming floor) is bound
by its grid gathers through L1 (Triton 3.6 has no indexed shared-memory load). It is not: every variant here
lands at 26.6–33 µs (gpu-notes "Session 8"); ncu puts both kernels at 75–83 % of L1/TEX throughput with
46–74 % excessive sectors: the scattered 4-byte weight loads over 110-byte blocks and the activation
re-reads bind them, not the lookups and not the instruction count. Kept as a harness (`rows_timing.py
--nvrtc`) for the next step that needs explicit shared memory: coalesced staging of the weight rows.

Layout and lane map as in the Triton kernel: 8 lanes per 110-byte block (lane c takes sub-block c: 32
weights, 8 grid words), a warp 4 consecutive blocks of one row per step and `UNROLL` steps' loads in
flight; the warps of a persistent grid (the table filled once per CTA) take rows in turn. Weights are read as
aligned int32 words and funnel-shifted (a block starts 0 or 2 bytes into a word); activations are the int8
codes and per-32 scales of `QuantizedActivation`. Plain table: 32 copies of the 2 KB grid side by side
(lane L reads bank L only: one wavefront per lookup); per grid word the 9-bit index by one `prmt`, the sign
byte mask by a multiply and a sign-replicating `prmt` (as in the Triton kernel), Σ σ·g·x = dp4a(g ^ M, x) −
dp4a(M, x) at one or two columns, one dp4a of the signed word (g ^ M) + (M & 0x01010101) above. "_sg": one
32 KB table of the signed words of all 16 sign patterns (index, qh bit and sign nibble by one `prmt`: 4
instructions a lookup instead of 8.5, ~3.5-way bank conflicts).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ninfer.kernels.gemv_il import CUDA_HELPERS
from ninfer.kernels.gemv_q8 import QuantizedActivation
from ninfer.kernels.gguf_matmul import QuantKernelError, _tables, check_weight

MAX_COLUMNS = 8
_OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_SOURCE = r"""
#define OUT_KIND __OUT_KIND__
#define NCOL __NCOL__
#define UNROLL __UNROLL__
#define WARPS __WARPS__
#define MIN_CTAS __MIN_CTAS__
#define SIGNED __SIGNED__
""" + CUDA_HELPERS + r"""
__device__ __forceinline__ unsigned shf(unsigned lo, unsigned hi, unsigned sh) {
    unsigned r; asm("shf.r.clamp.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(sh)); return r;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_CTAS)
iq3s_gemv(const unsigned* __restrict__ w, const int* __restrict__ xw, const float* __restrict__ xd,
          const unsigned* __restrict__ grid, out_t* __restrict__ y, int N, int K, int row_bytes, int stride_y)
{
    extern __shared__ unsigned table[];
#if SIGNED
    // word i | s << 9: grid word i with byte k negated where bit k of s (one copy, 32 KB)
    for (int i = threadIdx.x; i < 512 * 16; i += WARPS * 32) table[i] = grid[i];
#else
    // grid word i, copy L at i * 32 + L: lane L reads bank L only
    for (int i = threadIdx.x; i < 512 * 32; i += WARPS * 32) table[i] = grid[i >> 5];
#endif
    __syncthreads();
    const unsigned lane = threadIdx.x & 31;
#if SIGNED
    const unsigned tab = (unsigned)__cvta_generic_to_shared(table);
#else
    const unsigned tab = (unsigned)__cvta_generic_to_shared(table) + 4 * lane;  // + 128 bytes per grid word
#endif
    const int nblk = K >> 8, K4 = K >> 2, K32 = K >> 5;
    const int c = lane & 7, b = lane >> 3;
    const int steps = (nblk - b + 3) >> 2;  // this lane's blocks b, b + 4, ... (110 words per step)
    const int* xl = xw + b * 64 + 8 * c;     // + 256 words per step
    const float* dl = xd + b * 8 + c;        // + 32 per step
    for (int row = blockIdx.x * WARPS + (threadIdx.x >> 5); row < N; row += gridDim.x * WARPS) {
        float acc[NCOL];
#pragma unroll
        for (int m = 0; m < NCOL; ++m) acc[m] = 0.f;
        // the lane's first block; every step moves 440 bytes, so the alignment inside words stays
        const unsigned off = (unsigned)row * row_bytes + b * 110;  // the weight is < 4 GB (host check)
        const unsigned lead = off & 3;  // 0 or 2
        const unsigned id = off >> 2;
        const unsigned iq = (off + 2 + 8 * c) >> 2;       // qs bytes 8c..8c+7
        const unsigned ih = (off + 66 + c) >> 2;          // qh byte c
        const unsigned is = (off + 74 + 4 * c) >> 2;      // sign bytes 4c..4c+3
        const unsigned ic = (off + 106 + (c >> 1)) >> 2;  // scale byte c / 2
        const unsigned sh = ((lead + 2) & 3) * 8;  // qs and signs start 2 bytes after d
        const unsigned sh_h = ((lead + 2 + c) & 3) * 8;
        const unsigned sh_c = ((lead + 2 + (c >> 1)) & 3) * 8 + 4 * (c & 1);
        const unsigned sh_d = lead * 8;
        for (int s0 = 0; s0 < steps; s0 += UNROLL) {
            unsigned wd[UNROLL], q0w[UNROLL], q1w[UNROLL], q2w[UNROLL], hw[UNROLL], s0w[UNROLL], s1w[UNROLL],
                cw[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                if (s0 + u < steps) {
                    const unsigned o = (s0 + u) * 110;
                    wd[u] = w[id + o];
                    const unsigned* q = w + (iq + o);
                    q0w[u] = q[0]; q1w[u] = q[1]; q2w[u] = q[2];
                    hw[u] = w[ih + o];
                    const unsigned* sp = w + (is + o);
                    s0w[u] = sp[0]; s1w[u] = sp[1];
                    cw[u] = w[ic + o];
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                if (s0 + u < steps) {
                    const int* xs = xl + (s0 + u) * 256;
                    const float* ds = dl + (s0 + u) * 32;
                    const unsigned q0 = shf(q0w[u], q1w[u], sh), q1 = shf(q1w[u], q2w[u], sh);
                    const unsigned sg = shf(s0w[u], s1w[u], sh);
                    const unsigned qh = hw[u] >> sh_h;
                    const unsigned sc = (cw[u] >> sh_c) & 15;
                    const float dw = f16_lo(wd[u] >> sh_d) * (float)(1 + 2 * sc);
                    const unsigned h0 = ((qh & 15) * 0x204081u) & 0x01010101u;  // qh bit k -> byte k
                    const unsigned h1 = (((qh >> 4) & 15) * 0x204081u) & 0x01010101u;
                    int ig[NCOL], im[NCOL];
#pragma unroll
                    for (int m = 0; m < NCOL; ++m) { ig[m] = 0; im[m] = 0; }
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        int4 xv[NCOL];
#pragma unroll
                        for (int m = 0; m < NCOL; ++m)
                            xv[m] = *reinterpret_cast<const int4*>(xs + m * K4 + 4 * half);
#if SIGNED
                        // byte e: qh bit e | sign nibble of grid word 4 half + e << 1
                        // (p: [sign byte, 0, sign byte, 0])
                        const unsigned p = prmt(sg, 0, half ? 0x4342 : 0x4140);
                        const unsigned tw = (((p << 1) | (p << 5)) & 0x1E1E1E1Eu) | (half ? h1 : h0);
#endif
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
#if SIGNED
                            const unsigned sw = lds(tab + 4 * prmt(half ? q1 : q0, tw, 0xCC40 + 0x11 * e));
#else
                            const unsigned idx = prmt(half ? q1 : q0, half ? h1 : h0, 0xCC40 + 0x11 * e);
                            const unsigned g = lds(tab + (idx << 7));
                            const unsigned byte = prmt(sg, 0, 0x4440 + 2 * half + (e >> 1));
                            const unsigned m8 = prmt(byte * ((e & 1) ? 0x08040201u : 0x80402010u), 0, 0x89AB);
                            const unsigned gm = g ^ m8;
#if NCOL > 2
                            const unsigned sw = gm + (m8 & 0x01010101u);  // the signed bytes
#endif
#endif
#pragma unroll
                            for (int m = 0; m < NCOL; ++m) {
                                const int xe = e == 0 ? xv[m].x : e == 1 ? xv[m].y
                                             : e == 2 ? xv[m].z : xv[m].w;
#if SIGNED || NCOL > 2
                                ig[m] = dp4a(sw, xe, ig[m]);
#else
                                ig[m] = dp4a(gm, xe, ig[m]);
                                im[m] = dp4a(m8, xe, im[m]);
#endif
                            }
                        }
                    }
#pragma unroll
                    for (int m = 0; m < NCOL; ++m) acc[m] += dw * ds[m * K32] * (float)(ig[m] - im[m]);
                }
            }
        }
#pragma unroll
        for (int m = 0; m < NCOL; ++m) {
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], o);
        }
        if (lane < NCOL) {
            float v = acc[0];
#pragma unroll
            for (int m = 1; m < NCOL; ++m) v = lane == m ? acc[m] : v;
            y[lane * stride_y + row] = to_out(v);
        }
    }
}
"""


@dataclass(frozen=True)
class CudaSchedule:
    """`warps` per CTA (each takes whole rows), `unroll` steps of 4 blocks loaded before any is used;
    `signed`: one 32 KB table of every grid word under all 16 sign patterns instead of 32 copies of the
    2 KB grid (one lookup gives the signed word; ~3.5-way bank conflicts)."""

    name: str
    warps: int = 8
    unroll: int = 4
    signed: bool = False
    ctas: int = 0  # CTAs per SM to build for (registers ≤ 65536 / threads); 0: min_ctas's choice
    kernel: str = "cuda"

    @property
    def table_bytes(self) -> int:
        return 512 * 16 * 4 if self.signed else 512 * 32 * 4


# the best of each kind in session 8 (H200, 17408×5120 at 1 column: 26.6, 29.4, 29.3, 27.6, 31.7 µs)
SCHEDULES = {s.name: s for s in (CudaSchedule("cu_iq3s_w8_u1", 8, 1), CudaSchedule("cu_iq3s_w8_u2", 8, 2),
                                 CudaSchedule("cu_iq3s_w8_u1_sg", 8, 1, True),
                                 CudaSchedule("cu_iq3s_w8_u2_sg", 8, 2, True),
                                 CudaSchedule("cu_iq3s_w8_u1_sg_c6", 8, 1, True, 6))}


def min_ctas(s: CudaSchedule) -> int:
    """CTAs per SM the kernel is built for: as many as 228 KB of shared memory (Hopper) hold, at most 64
    registers a thread below 2048 threads."""
    if s.ctas:
        return s.ctas
    return max(1, min(228 * 1024 // (s.table_bytes + 1024), 65536 // (64 * 32 * s.warps)))


def kernel_source(columns: int, out_kind: int, s: CudaSchedule) -> str:
    return (_SOURCE.replace("__OUT_KIND__", str(out_kind)).replace("__NCOL__", str(columns))
            .replace("__UNROLL__", str(s.unroll)).replace("__WARPS__", str(s.warps))
            .replace("__MIN_CTAS__", str(min_ctas(s))).replace("__SIGNED__", str(int(s.signed))))


@functools.cache
def _compiled(columns: int, out_kind: int, s: CudaSchedule):
    kernel = torch.cuda._compile_kernel(kernel_source(columns, out_kind, s), "iq3s_gemv")
    kernel.set_shared_memory_config(s.table_bytes)
    return kernel


@functools.cache
def _table(device: torch.device, signed: bool) -> torch.Tensor:
    from ninfer.kernels.gemv_rows_iq import _grid_words

    return _grid_words(device, True) if signed else _tables(device)[1]


@functools.cache
def _ctas_per_sm(device: torch.device, s: CudaSchedule) -> int:
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    return max(1, min(smem // (s.table_bytes + 1024), props.max_threads_per_multi_processor // (32 * s.warps),
                      min_ctas(s)))


def gemv_cuda_iq3s(raw: torch.Tensor, xa: QuantizedActivation, out_features: int,
                   schedule: CudaSchedule | str) -> torch.Tensor:
    """`(q·d) @ Wᵀ -> [n, out_features]` in `xa.dtype`, W the iq3_s GGUF rows `raw` (uint8 `[N, row_bytes]`,
    CUDA) and xa the int8 activation (1–8 columns)."""
    from ninfer.kernels.gemv_rows_iq import _aligned_words

    s = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
    n, k = xa.q.shape
    check_weight(raw, "iq3_s", out_features, k)
    if raw.numel() >= 1 << 32:
        raise QuantKernelError(f"schedule {s.name} addresses the weight in 32 bits; {raw.numel()} bytes is "
                               "too many, pick a rows_iq_* schedule")
    if not raw.is_cuda:
        raise QuantKernelError(f"schedule {s.name} is a CUDA kernel; the weight is on {raw.device}")
    if not 1 <= n <= MAX_COLUMNS or k % 256:
        raise QuantKernelError(f"schedule {s.name} takes 1-{MAX_COLUMNS} columns of whole 256-column blocks, "
                               f"got {n}×{k}")
    if xa.dtype not in _OUT_KINDS:
        raise QuantKernelError(f"schedule {s.name} writes float32, bfloat16 or float16, not {xa.dtype}")
    kernel = _compiled(n, _OUT_KINDS[xa.dtype], s)
    y = torch.empty((n, out_features), dtype=xa.dtype, device=raw.device)
    sms = torch.cuda.get_device_properties(raw.device).multi_processor_count
    ctas = min(-(-out_features // s.warps), sms * _ctas_per_sm(raw.device, s))
    args = [_aligned_words(raw), xa.words.contiguous(), xa.d.contiguous(), _table(raw.device, s.signed), y,
            out_features, k, raw.shape[1], y.stride(0)]
    kernel(grid=(ctas, 1, 1), block=(32 * s.warps, 1, 1), args=args, shared_mem=s.table_bytes)
    return y
