"""Run the NVRTC kernels' CUDA C source on the CPU, for tests: the very source `torch.cuda._compile_kernel`
builds on a GPU, compiled by the host's C++ compiler with every CUDA thread an OS thread.

What the emulation gives a kernel (`PRELUDE`): `threadIdx` / `blockIdx` / `gridDim` / `blockDim`, dynamic
shared memory a CTA (filled with 0xA5 bytes: a read before a write shows), `__syncthreads` as a barrier of the
CTA's threads (a thread that returns stops counting, as on the GPU; a barrier that waits 60 s aborts the
process: a deadlock), the load intrinsics as plain loads (`__ldg` of shared memory aborts), `atomicAdd` and
`__threadfence` as host atomics, `cp.async` copies that land only at the copying thread's `wait_group` (a
misaligned one aborts).
The source's inline-PTX helpers (`prmt`, `dp4a`, the mma instructions, the conversions) are swapped, by name,
for C++ written from the PTX ISA's definitions (`EMULATED`); the mma ones exchange their fragments through
the warp (a barrier of its 32 threads), by the fragment tables of the PTX ISA (the same
as `conftest`'s numpy `ptx_mma_m16n8k32`). A helper with inline PTX that has no emulation fails the build,
by name.

CTAs run one after another (no kernel here waits on another CTA), a cluster's (`CLUSTER` > 1 in the source)
at once: `cluster_sync` a barrier of its threads (`cluster_arrive` / `cluster_wait` its halves), `st_rank0` a
store into its rank-0 CTA's shared memory. So what this checks is a kernel's arithmetic, indexing,
shared-memory use and barriers on tiny shapes — not its speed, nor what PDL orders (sources are built with
PDL 0). Floating point is the host's: no FMA contraction of `a * b + c`, so results agree with the GPU's to
rounding, not bit for bit."""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch

PRELUDE = r"""
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#define __device__
#define __host__
#define __forceinline__ inline
#define __global__
#define __launch_bounds__(...)
#define __cluster_dims__(...)
#define __restrict__ __restrict

// bytes asked into L2 by a launch's `prefetch_l2`s (HostKernel.prefetched)
extern "C" { std::atomic<unsigned long long> emu_prefetched{0}; }

struct dim3_ { unsigned x, y, z; };
struct uint4 { unsigned x, y, z, w; };
struct int4 { int x, y, z, w; };
struct int2 { int x, y; };
struct uint2 { unsigned x, y; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline int2 make_int2(int x, int y) { return {x, y}; }

// a barrier of `expected` threads; drop(): a thread that finished stops counting
struct EmuBarrier {
    std::mutex m;
    std::condition_variable cv;
    int expected = 0, arrived = 0;
    unsigned long phase = 0;
    void wait() { wait_for(arrive()); }
    // a split barrier's halves: arrive() counts this thread and returns its phase, wait_for(phase) waits
    // until every thread has arrived in it
    unsigned long arrive() {
        std::unique_lock<std::mutex> lock(m);
        const unsigned long mine = phase;
        if (++arrived == expected) { arrived = 0; ++phase; cv.notify_all(); }
        return mine;
    }
    void wait_for(unsigned long mine) {
        std::unique_lock<std::mutex> lock(m);
        if (!cv.wait_for(lock, std::chrono::seconds(60), [&] { return phase != mine; })) {
            std::fprintf(stderr, "cuda_cpu: a barrier waited 60 s (%d of %d threads arrived): deadlock\n",
                         arrived, expected);
            std::abort();
        }
    }
    void drop() {
        std::unique_lock<std::mutex> lock(m);
        --expected;
        if (arrived > 0 && arrived == expected) { arrived = 0; ++phase; cv.notify_all(); }
    }
};

struct EmuWarp {  // the operands of a warp-wide instruction, exchanged through this
    EmuBarrier bar;
    unsigned a[32][4];
    int b[32][2];
};

static thread_local dim3_ threadIdx, blockIdx;
static dim3_ gridDim, blockDim;
static thread_local char* emu_smem;
static thread_local char* emu_smem_end;
static thread_local EmuBarrier* emu_cta;
static thread_local EmuWarp* emu_warp;
static thread_local EmuBarrier* emu_cluster;  // every thread of the CTA's cluster
static thread_local char** emu_cluster_smem;  // the cluster's CTAs' shared memory, by rank
static thread_local unsigned long emu_cluster_phase;  // of this thread's last cluster_arrive

// cp.async: a lane's 16-byte copies wait in its committed groups and land at its wait_group (oldest first),
// so a slot read before its wait, or before the warp's barrier after it, holds what it held before
struct EmuCopy { char* dst; const char* src; };
static thread_local std::vector<std::vector<EmuCopy>> emu_groups;
static thread_local std::vector<EmuCopy> emu_open;
inline void emu_cp_async(unsigned dst, const void* src) {
    if (dst % 16 || (size_t)src % 16) {  // cp.async of 16 bytes: both addresses 16-byte aligned
        std::fprintf(stderr, "cuda_cpu: cp.async of 16 bytes from %p to shared %u: misaligned\n", src, dst);
        std::abort();
    }
    emu_open.push_back({emu_smem + dst, (const char*)src});
}
inline void emu_cp_commit() { emu_groups.push_back(emu_open); emu_open.clear(); }
inline void emu_cp_wait(int pending) {
    while ((int)emu_groups.size() > pending) {
        for (const EmuCopy& c : emu_groups.front()) std::memcpy(c.dst, c.src, 16);
        emu_groups.erase(emu_groups.begin());
    }
}

inline void __syncthreads() { emu_cta->wait(); }
// warp-wide exchanges through the warp's operand slots (a barrier of its threads before and after)
template <class T> inline T __shfl_xor_sync(unsigned, T v, int mask) {
    static_assert(sizeof(T) == 4, "cuda_cpu: 32-bit shuffles only");
    const unsigned lane = threadIdx.x & 31u;
    EmuWarp& w = *emu_warp;
    std::memcpy(&w.a[lane][0], &v, 4);
    w.bar.wait();
    T r;
    std::memcpy(&r, &w.a[lane ^ (unsigned)mask][0], 4);
    w.bar.wait();
    return r;
}
inline unsigned __ballot_sync(unsigned, int p) {
    const unsigned lane = threadIdx.x & 31u;
    EmuWarp& w = *emu_warp;
    w.a[lane][0] = p != 0;
    w.bar.wait();
    unsigned r = 0;
    for (int i = 0; i < w.bar.expected; ++i) r |= w.a[i][0] << i;
    w.bar.wait();
    return r;
}
inline int __ffs(unsigned v) { return v ? __builtin_ctz(v) + 1 : 0; }
inline void __nanosleep(unsigned) { std::this_thread::yield(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp->bar.wait(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
template <class T> inline T __ldg(const T* p) {  // ld.global.nc: never shared memory
    if ((const char*)p >= emu_smem && (const char*)p < emu_smem_end) {
        std::fprintf(stderr, "cuda_cpu: __ldg of a shared-memory address\n");
        std::abort();
    }
    return *p;
}
template <class T> inline T __ldcg(const T* p) {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    T v;
    std::memcpy(&v, (const void*)p, sizeof(T));
    return v;
}
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline float atomicAdd(float* p, float v) {
    static std::mutex m;
    std::lock_guard<std::mutex> lock(m);
    const float old = *p;
    *p = old + v;
    return old;
}
inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
inline float __int_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
inline float __uint_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
inline int __float_as_int(float f) { int v; std::memcpy(&v, &f, 4); return v; }
inline unsigned __float_as_uint(float f) { unsigned v; std::memcpy(&v, &f, 4); return v; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
// shared-window addresses: offsets into the CTA's shared memory
inline unsigned __cvta_generic_to_shared(const void* p) { return (unsigned)((const char*)p - emu_smem); }

inline float emu_half_to_float(unsigned h) {
    const unsigned s = (h >> 15) & 1u, e = (h >> 10) & 31u, m = h & 1023u;
    float v = e == 0 ? std::ldexp((float)m, -24)
              : e == 31 ? (m ? NAN : INFINITY) : std::ldexp((float)(m | 1024u), (int)e - 25);
    return s ? -v : v;
}
inline unsigned short emu_float_to_bf16(float f) {  // round to nearest even
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline unsigned short emu_float_to_half(float f) {
    _Float16 h = (_Float16)f;  // round to nearest even (IEEE)
    unsigned short r; std::memcpy(&r, &h, 2); return r;
}
inline unsigned emu_prmt(unsigned a, unsigned b, unsigned s) {  // PTX prmt.b32, default mode
    const unsigned long long v = (unsigned long long)a | ((unsigned long long)b << 32);
    unsigned r = 0;
    for (int k = 0; k < 4; ++k) {
        const unsigned nib = (s >> (4 * k)) & 15u;
        unsigned byte = (unsigned)(v >> (8 * (nib & 7u))) & 0xffu;
        if (nib & 8u) byte = (byte & 0x80u) ? 0xffu : 0u;
        r |= byte << (8 * k);
    }
    return r;
}
inline int emu_byte(unsigned w, int i, bool is_signed) {
    const unsigned b = (w >> (8 * i)) & 0xffu;
    return is_signed ? (int)(signed char)b : (int)b;
}
// mma.m16n8k{16,32}.row.col.s32.{u8,s8}.s8.s32, lane 4g + t (K = 16: a0, a1 rows g, g + 8 at k 4t; K = 32:
// a0..a3 rows g, g + 8, g, g + 8 at k 4t, 4t, 16 + 4t, 16 + 4t; b word i holds k 4t + 16 i .. + 3 of column
// g; d rows g, g, g + 8, g + 8, columns 2t, 2t + 1, 2t, 2t + 1)
template <int K, bool A_SIGNED>
inline void emu_mma(int (&c)[4], const unsigned (&a)[4], const int (&b)[2]) {
    const unsigned lane = threadIdx.x & 31u;
    EmuWarp& w = *emu_warp;
    for (int i = 0; i < 4; ++i) w.a[lane][i] = a[i];
    w.b[lane][0] = b[0];
    w.b[lane][1] = b[1];
    w.bar.wait();
    const int g = (int)(lane >> 2), t = (int)(lane & 3u);
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        long long sum = 0;
        for (int k = 0; k < K; ++k) {
            // A: the lane holding (row, k) and its word and byte
            const int q = (k & 15) >> 2, hi = k >> 4, a_lane = 4 * (row & 7) + q;
            const int a_word = (K == 16) ? (row >> 3) : ((row >> 3) + 2 * hi);
            const int av = emu_byte(w.a[a_lane][a_word], k & 3, A_SIGNED);
            const int bv = emu_byte((unsigned)w.b[4 * col + q][hi], k & 3, true);
            sum += (long long)av * bv;
        }
        c[i] = (int)((long long)c[i] + sum);
    }
    w.bar.wait();
}
"""

# inline-PTX helpers of the kernel sources and their C++ (the same signatures)
EMULATED = {
    "prmt": "inline unsigned prmt(unsigned a, unsigned b, unsigned s) { return emu_prmt(a, b, s); }",
    "dp4a": """inline int dp4a(unsigned a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += emu_byte(a, i, true) * emu_byte((unsigned)b, i, true);
    return c;
}""",
    "lds": """inline unsigned lds(unsigned addr) {
    unsigned v; std::memcpy(&v, emu_smem + addr, 4); return v;
}""",
    "f16_lo": "inline float f16_lo(unsigned v) { return emu_half_to_float(v & 0xffffu); }",
    "f16_hi": "inline float f16_hi(unsigned v) { return emu_half_to_float(v >> 16); }",
    "to_out": """inline out_t to_out(float v) {
#if OUT_KIND == 0
    return v;
#elif OUT_KIND == 1
    return emu_float_to_bf16(v);
#else
    return emu_float_to_half(v);
#endif
}""",
    "mul_hi": """inline unsigned mul_hi(unsigned a, unsigned b) {
    return (unsigned)(((unsigned long long)a * b) >> 32);
}""",
    "mma_s8": """inline void mma_s8(int (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                   int b0, int b1) {
    const unsigned a[4] = {a0, a1, a2, a3};
    const int b[2] = {b0, b1};
    emu_mma<32, true>(c, a, b);
}""",
    "cluster_sync": "inline void cluster_sync() { emu_cluster->wait(); }",
    "cluster_arrive": "inline void cluster_arrive() { emu_cluster_phase = emu_cluster->arrive(); }",
    "cluster_wait": "inline void cluster_wait() { emu_cluster->wait_for(emu_cluster_phase); }",
    "st_rank0": """inline void st_rank0(float* p, float v) {
    std::memcpy(emu_cluster_smem[0] + ((char*)p - emu_smem), &v, 4);
}""",
    # weight loads, evict-first or not: global memory only
    "evict_first": "inline unsigned long long evict_first() { return 0; }",
    "ldw4": "inline uint4 ldw4(const uint4* p) { return __ldg(p); }",
    "ldw": "inline unsigned ldw(const unsigned* p) { return __ldg(p); }",
    # the next GEMV's weights asked into L2: counted, each a 16-byte multiple at a 16-byte aligned address
    "prefetch_l2": """inline void prefetch_l2(const char* p, unsigned bytes) {
    if ((reinterpret_cast<std::uintptr_t>(p) | bytes) % 16 || bytes == 0) {
        std::fprintf(stderr, "cuda_cpu: a bulk prefetch of %u bytes at %p: not 16-byte multiples\\n",
                     bytes, p);
        std::abort();
    }
    emu_prefetched += bytes;
}""",
    "ld_acquire": "inline int ld_acquire(const int* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }",
    "ld_relaxed": "inline int ld_relaxed(const int* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }",
    "fence_acq_rel": "inline void fence_acq_rel() { std::atomic_thread_fence(std::memory_order_acq_rel); }",
    "red_release_add": """inline void red_release_add(int* p, int v) {
    __atomic_fetch_add(p, v, __ATOMIC_RELEASE);
}""",
    "cp_async16": "inline void cp_async16(unsigned dst, const void* src) { emu_cp_async(dst, src); }",
    "cp_async_commit": "inline void cp_async_commit() { emu_cp_commit(); }",
    "cp_async_wait_stages": "inline void cp_async_wait_stages() { emu_cp_wait(STAGES - 1); }",
    # two forms: m16n8k32 (four A words, two B) and m16n8k16 (two A words, one B)
    "mma_u8s8": """inline void mma_u8s8(int (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                     int b0, int b1) {
    const unsigned a[4] = {a0, a1, a2, a3};
    const int b[2] = {b0, b1};
    emu_mma<32, false>(c, a, b);
}
inline void mma_u8s8(int (&c)[4], unsigned a0, unsigned a1, int b0) {
    const unsigned a[4] = {a0, a1, 0u, 0u};
    const int b[2] = {b0, 0};
    emu_mma<16, false>(c, a, b);
}""",
}

_HELPER = re.compile(r"__device__ __forceinline__ [\w\s&*]+?\b(\w+)\(")
_SHARED = re.compile(r"extern __shared__ (\w+) (\w+)\[\];")
_KERNEL = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\)\s*)?'
                     r'(?:__cluster_dims__\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)')


def _body_end(source: str, start: int) -> int:
    """The index after the brace that closes the first `{` at or after `start`."""
    depth, i = 0, source.index("{", start)
    while True:
        if source[i] == "{":
            depth += 1
        elif source[i] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1


def _cxx() -> str:
    return os.environ.get("CXX", "g++")


def _preprocessed(text: str) -> str:
    """The source through the C preprocessor (its macros and `#if`s as the build sees them)."""
    try:
        run = subprocess.run([_cxx(), "-E", "-P", "-x", "c++", "-"], input=text, capture_output=True,
                             text=True)
    except FileNotFoundError as e:
        raise RuntimeError(f"cuda_cpu: no C++ compiler {_cxx()!r} (set CXX): the NVRTC kernels' CPU tests "
                           "build their source with one") from e
    if run.returncode:
        raise RuntimeError(f"cuda_cpu: preprocessing failed:\n{run.stderr[-4000:]}")
    return run.stdout


def host_source(source: str, kernel: str) -> str:
    """The kernel source made host C++: PTX helpers swapped, `extern __shared__` arrays pointed at the
    CTA's shared memory, and an `emu_launch` entry that runs the grid."""
    out, at = [], 0
    for m in _HELPER.finditer(source):
        end = _body_end(source, m.end())
        if "asm" not in source[m.start():end]:
            continue
        name = m.group(1)
        if name not in EMULATED:
            raise NotImplementedError(f"cuda_cpu: the helper {name!r} uses inline PTX and has no emulation")
        out += [source[at:m.start()], EMULATED[name]]
        at = end
    text = "".join(out) + source[at:]
    built = _preprocessed(text)  # (the build's own text keeps its macros: the emulated helpers use them)
    if re.search(r"\basm\b", built):
        raise NotImplementedError("cuda_cpu: inline PTX outside the helpers (PDL 0 leaves none)")
    text = _SHARED.sub(lambda m: f"{m.group(1)}* {m.group(2)} = reinterpret_cast<{m.group(1)}*>(emu_smem);",
                       text)
    sig = next(m for m in _KERNEL.finditer(built) if m.group(1) == kernel)
    params = [p.strip() for p in sig.group(2).split(",") if p.strip()]
    types = [re.sub(r"\s*\b\w+$", "", p).replace("__restrict__", "").strip() for p in params]
    call = ", ".join(f"*reinterpret_cast<{ty}*>(args[{i}])" for i, ty in enumerate(types))
    return PRELUDE + text + f"""
extern "C" void emu_launch(unsigned grid, unsigned block, unsigned long smem_bytes, void** args) {{
#ifdef CLUSTER
    const unsigned cluster = CLUSTER;
#else
    const unsigned cluster = 1;
#endif
    if (grid % cluster) {{
        std::fprintf(stderr, "cuda_cpu: a grid of %u CTAs in clusters of %u\\n", grid, cluster);
        std::abort();
    }}
    gridDim = {{grid, 1, 1}};
    blockDim = {{block, 1, 1}};
    for (unsigned first = 0; first < grid; first += cluster) {{  // a cluster's CTAs at once
        std::vector<std::vector<char>> smem(cluster, std::vector<char>(smem_bytes + 16, (char)0xA5));
        std::vector<char*> smem_of(cluster);
        std::vector<EmuBarrier> bars(cluster);
        std::vector<std::vector<EmuWarp>> warps(cluster);
        EmuBarrier cluster_bar;
        cluster_bar.expected = (int)(cluster * block);
        std::vector<std::thread> threads;
        for (unsigned r = 0; r < cluster; ++r) {{
            smem_of[r] = smem[r].data();
            bars[r].expected = (int)block;
            warps[r] = std::vector<EmuWarp>((block + 31) / 32);
            for (unsigned i = 0; i < warps[r].size(); ++i)
                warps[r][i].bar.expected = (int)std::min(32u, block - 32 * i);
        }}
        for (unsigned r = 0; r < cluster; ++r)
            for (unsigned x = 0; x < block; ++x)
                threads.emplace_back([&, r, x] {{
                    threadIdx = {{x, 0, 0}};
                    blockIdx = {{first + r, 0, 0}};
                    emu_smem = smem[r].data();
                    emu_smem_end = smem[r].data() + smem[r].size();
                    emu_cta = &bars[r];
                    emu_warp = &warps[r][x / 32];
                    emu_cluster = &cluster_bar;
                    emu_cluster_smem = smem_of.data();
                    {kernel}({call});
                    emu_warp->bar.drop();
                    emu_cta->drop();
                    emu_cluster->drop();
                }});
        for (auto& th : threads) th.join();
    }}
}}
"""


def _cache_dir() -> Path:
    path = Path(os.environ.get("NINFER_CUDA_CPU_CACHE", Path(tempfile.gettempdir()) / "ninfer-cuda-cpu"))
    path.mkdir(parents=True, exist_ok=True)
    return path


class HostKernel:
    """A kernel source built for the host; called like torch's NVRTC kernels (`grid`, `block`, `args`,
    `shared_mem`), on CPU tensors and Python ints / floats (int / double parameters)."""

    def __init__(self, source: str, kernel: str):
        text = host_source(source, kernel)
        digest = hashlib.sha256(text.encode()).hexdigest()[:20]
        lib = _cache_dir() / f"{kernel}-{digest}.so"
        if not lib.exists():  # built once a source; pytest-xdist's workers may race: each its own files
            cpp = lib.with_suffix(f".{os.getpid()}.cpp")
            cpp.write_text(text)
            tmp = lib.with_suffix(f".{os.getpid()}.tmp")
            cmd = [_cxx(), "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-fno-strict-aliasing", "-w",
                   str(cpp), "-o", str(tmp)]
            run = subprocess.run(cmd, capture_output=True, text=True)
            cpp.unlink()
            if run.returncode:
                raise RuntimeError(f"cuda_cpu: building {kernel} failed:\n{run.stderr[-4000:]}")
            os.replace(tmp, lib)
        self._lib = ctypes.CDLL(str(lib))
        self._lib.emu_launch.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_ulong,
                                         ctypes.POINTER(ctypes.c_void_p)]

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        grid = grid[0] if isinstance(grid, tuple) else grid
        block = block[0] if isinstance(block, tuple) else block
        values = []
        for a in args:
            if isinstance(a, torch.Tensor):
                if a.device.type != "cpu" or not a.is_contiguous():
                    raise ValueError("cuda_cpu: kernel arguments are contiguous CPU tensors")
                values.append(ctypes.c_void_p(a.data_ptr()))
            elif isinstance(a, float):  # a double, as torch's NVRTC launcher passes it
                values.append(ctypes.c_double(a))
            else:
                values.append(ctypes.c_int(a))
        ptrs = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p)
                                                   for v in values])
        counter = ctypes.c_ulonglong.in_dll(self._lib, "emu_prefetched")
        counter.value = 0
        self._lib.emu_launch(grid, block, shared_mem, ptrs)
        self.prefetched = counter.value  # bytes its `prefetch_l2`s asked for
