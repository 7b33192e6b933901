"""A chain of dependent decode GEMVs as the engine launches them (a kernel each, programmatic dependent
launch, one CUDA graph) against one persistent kernel whose warps start the next GEMV's rows as soon as the
inputs they need are written ("dataflow"): what the launch boundaries cost a memory-bound chain, measured on
one inner loop.

Why: the decode round is ~256 dependent GEMVs (four a layer), each paying a ramp, a tail and a gap at its
launch boundary (~4 µs on the H200, gpu-notes "Session 60"); every overlap tried inside the launch-per-kernel
structure lost (sessions 45, 55, 62-64). A persistent kernel with a grid barrier between GEMVs keeps the tail
(a GEMV needs its whole input). With readiness counters per 256 inputs instead, a warp that finishes its rows
of GEMV l takes rows of GEMV l + 1 and works through the input chunks already written while GEMV l's last
rows are still streaming — if that recovered most of the boundary's cost, the decode step would be worth
rebuilding that way (its norms too: an RMSNorm's scale is one number a column that commutes with the GEMV
after it).

Measured (session 65, H100; gpu-notes "Session 65"): it does not. The PDL launches are the fastest form at
every setting (26.9 µs a GEMV on the 27B-sized chain); the dataflow launch is 2.6 µs a GEMV slower, one launch
with a barrier between GEMVs 2.8-6.6 µs, and the light release / acquire forms slower still: the
synchronisation costs more than the launch boundary it replaces.

The inner loop is the same in every form: fp16 weights `[n, k]` row-major, fp16 activations, fp32 sums; a
warp item is RPW rows over all k, a lane takes 8 inputs of every 256-input chunk (one 16-byte load a row), the
weights of UNROLL chunks loaded before their inputs are asked for. In dataflow form each finished item adds
one to its output chunk's counter (a fence, then an atomic; SYNC 1: a release reduction), and a warp asks for
the counters of up to 32 chunks at once (acquire loads, one lane a chunk; SYNC 1: relaxed loads and a fence
after them) before reading those inputs (`ld.global.cg`: written during the kernel); items are dealt to
warps in order, GEMV by GEMV, so an item only waits on earlier ones: no deadlock while every CTA is resident
(the grid is the SMs × CTAs an SM). The barrier form is the same launch whose warps wait for a GEMV's whole
input before its first chunk: what the launches alone cost, apart from the overlap.

    python3 bench/dataflow_chain.py --layers 16              # a GPU: check against torch, time every form
    python3 bench/dataflow_chain.py --rpw 2,4 --unroll 2,4 --inner 1536,3072

`tests/test_dataflow_chain.py` runs the CUDA C on the CPU (`tests/cuda_cpu.py`, every CTA at once).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.kernels.gemv_il import CUDA_HELPERS, _launch  # noqa: E402

CHUNK = 256  # inputs a readiness counter covers (a lane's 8 × 32 lanes)

SOURCE = r"""
#define OUT_KIND 2
#define WARPS __WARPS__
#define MIN_CTAS __MIN_CTAS__
#define RPW __RPW__
#define UNROLL __UNROLL__
#define DATAFLOW __DATAFLOW__
#define PDL __PDL__
#define SYNC __SYNC__
""" + CUDA_HELPERS + r"""
#if PDL == 2
// the next GEMV's first weight bytes asked into L2 as a launch's warps finish (as the engine's GEMVs do,
// sessions 58-60)
__device__ __forceinline__ void prefetch_l2(const char* p, unsigned bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
}
#endif
__device__ __forceinline__ int ld_acquire(const int* p) {
    int v; asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
// SYNC 1, the light forms: polls relaxed and one acquire fence after them (an acquire load invalidates L1
// each time: CCTL.IVALL), the count a release reduction (not MEMBAR.SC + atomic)
__device__ __forceinline__ int ld_relaxed(const int* p) {
    int v; asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ void fence_acq_rel() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ void red_release_add(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// the first chunk at or after `known` whose counter has not reached `target` (chunks past the end count as
// written): one load a lane (acquire; SYNC 1: relaxed), 32 chunks a call
__device__ __forceinline__ int poll(const int* cnt, int known, int chunks, int target, unsigned lane) {
    const int c = known + (int)lane;
    const bool ok = c >= chunks || (SYNC ? ld_relaxed(cnt + c) : ld_acquire(cnt + c)) >= target;
    const unsigned m = __ballot_sync(0xffffffffu, ok);
    __syncwarp();  // what the lanes' acquires saw, seen by the whole warp
    const int run = m == 0xffffffffu ? 32 : __ffs(~m) - 1;
    return min(known + run, chunks);
}

__device__ __forceinline__ float dot8(const uint4& w, const float (&x)[8]) {
    float s = f16_lo(w.x) * x[0];
    s += f16_hi(w.x) * x[1];
    s += f16_lo(w.y) * x[2];
    s += f16_hi(w.y) * x[3];
    s += f16_lo(w.z) * x[4];
    s += f16_hi(w.z) * x[5];
    s += f16_lo(w.w) * x[6];
    s += f16_hi(w.w) * x[7];
    return s;
}

// GEMVs first .. last - 1 of the chain. `table`: 5 values a GEMV — its weight's address (fp16 [n, k]), n, k,
// its input's offset in `acts` (fp16 elements; GEMV l + 1's input is GEMV l's output; entry `last` gives the
// last output's), and its output's first chunk counter in `counts`
extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_CTAS)
chain_gemv(const long long* __restrict__ table, unsigned short* acts, int* counts, int first, int last)
{
    const unsigned lane = threadIdx.x & 31u;
    const int warp = blockIdx.x * WARPS + (int)(threadIdx.x >> 5), nwarps = gridDim.x * WARPS;
    int l = first, base = 0;  // the GEMV of item i, its first item
    int items = (int)table[5 * l + 1] / RPW;
#if PDL
    bool waited = false;
#endif
    for (int i = warp;; i += nwarps) {
        while (l < last && i >= base + items) {
            base += items;
            if (++l < last) items = (int)table[5 * l + 1] / RPW;
        }
        if (l >= last) break;
        const uint4* w = reinterpret_cast<const uint4*>(table[5 * l]);
        const int k = (int)table[5 * l + 2], k8 = k >> 3, chunks = k >> 8;
        const uint4* x = reinterpret_cast<const uint4*>(acts + table[5 * l + 3]);
        unsigned short* y = acts + table[5 * (l + 1) + 3];
        const int row0 = (i - base) * RPW;
#if DATAFLOW
        const int* ready = l > first ? counts + table[5 * (l - 1) + 4] : counts;
        int known = l > first ? 0 : chunks;  // input chunks [0, known) are written
#endif
        float acc[RPW];
#pragma unroll
        for (int j = 0; j < RPW; ++j) acc[j] = 0.f;
        for (int c0 = 0; c0 < chunks; c0 += UNROLL) {
            uint4 wv[UNROLL][RPW];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
#pragma unroll
                for (int j = 0; j < RPW; ++j)
                    wv[u][j] = c0 + u < chunks ? __ldg(w + (size_t)(row0 + j) * k8 + (c0 + u) * 32 + lane)
                                               : make_uint4(0u, 0u, 0u, 0u);
#if PDL
            if (!waited) {  // the first weights asked for before the wait, as the engine's GEMVs do
                asm volatile("griddepcontrol.wait;" ::: "memory");
                waited = true;
            }
#endif
#if DATAFLOW
            // DATAFLOW 2: the whole input first (a grid barrier between GEMVs, without the launches)
            while (known < (DATAFLOW == 2 ? chunks : min(c0 + UNROLL, chunks))) {
                const int was = known;
                known = poll(ready, known, chunks, 256 / RPW, lane);
                if (known == was) __nanosleep(64);  // fewer polls in L2 while the producers stream
#if SYNC
                else fence_acq_rel();
#endif
            }
#endif
            uint4 xv[UNROLL];  // every input of the group asked for at once (one L2 round trip, not UNROLL)
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
                xv[u] = c0 + u < chunks ? __ldcg(x + (c0 + u) * 32 + lane) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const float xf[8] = {f16_lo(xv[u].x), f16_hi(xv[u].x), f16_lo(xv[u].y), f16_hi(xv[u].y),
                                     f16_lo(xv[u].z), f16_hi(xv[u].z), f16_lo(xv[u].w), f16_hi(xv[u].w)};
#pragma unroll
                for (int j = 0; j < RPW; ++j) acc[j] += dot8(wv[u][j], xf);  // (past the end: zeros)
            }
        }
#if PDL
        if (l == last - 1 && i + nwarps >= base + items) {
            asm volatile("griddepcontrol.launch_dependents;");
#if PDL == 2
            // 4 KB a warp of the next GEMV's first 8 MiB
            const char* next = reinterpret_cast<const char*>(table[5 * last]);
            const long long at = 4096ll * warp, size = 2 * table[5 * last + 1] * table[5 * last + 2];
            if (next && lane == 0 && at < min(size, 8ll << 20)) prefetch_l2(next + at, 4096);
#endif
        }
#endif
#pragma unroll
        for (int j = 0; j < RPW; ++j) {
#pragma unroll
            for (int o = 16; o; o >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
            if (lane == (unsigned)j) y[row0 + j] = to_out(acc[j]);
        }
#if DATAFLOW
        __syncwarp();
        if (lane == 0) {  // the item's rows written: one more of its chunk's 256 / RPW items
#if SYNC
            red_release_add(counts + table[5 * l + 4] + (row0 >> 8), 1);
#else
            __threadfence();
            atomicAdd(counts + table[5 * l + 4] + (row0 >> 8), 1);
#endif
        }
#endif
    }
}
"""


def source(warps: int = 8, min_ctas: int = 2, rpw: int = 4, unroll: int = 4, dataflow: int = 0,
           pdl: int = 0, sync: int = 0) -> str:
    """The CUDA C of one build (`chain_gemv`); `dataflow` 1: one launch, each chunk when written, 2: one
    launch, each GEMV's whole input first; `pdl` 1: launched early, its first weights before the wait, 2:
    that and the next GEMV's first 8 MiB asked into L2 at the end; `sync` 1: the light release / acquire
    forms (SYNC)."""
    if 256 % rpw:
        raise ValueError(f"rows a warp item ({rpw}) must divide the 256-row chunk")
    values = {"WARPS": warps, "MIN_CTAS": min_ctas, "RPW": rpw, "UNROLL": unroll, "DATAFLOW": dataflow,
              "PDL": pdl, "SYNC": sync}
    text = SOURCE
    for key, value in values.items():
        text = text.replace(f"__{key}__", str(value))
    return text


class Chain:
    """GEMVs `shapes` ([(n, k)], each k the previous n) with random fp16 weights, their activations in one
    buffer and their chunk counters in another, on `device`."""

    def __init__(self, shapes: list[tuple[int, int]], device, seed: int = 0):
        for (n, k), (n_prev, _) in zip(shapes[1:], shapes[:-1], strict=True):
            if k != n_prev:
                raise ValueError(f"a chain's GEMV of {n}×{k} follows one of {n_prev} outputs")
        if any(n % CHUNK or k % CHUNK for n, k in shapes):
            raise ValueError(f"every n and k a multiple of {CHUNK}, got {shapes}")
        gen = torch.Generator().manual_seed(seed)
        self.shapes = shapes
        self.weights = [(torch.randn(n, k, generator=gen) / k ** 0.5).half().to(device) for n, k in shapes]
        sizes = [shapes[0][1]] + [n for n, _ in shapes]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.acts = torch.zeros(sum(sizes), dtype=torch.float16, device=device)
        self.acts[: sizes[0]] = torch.randn(sizes[0], generator=gen).half().to(device)
        counters = [0] + [sum(n // CHUNK for n, _ in shapes[:i]) for i in range(1, len(shapes) + 1)]
        self.counts = torch.zeros(max(counters[-1], 1), dtype=torch.int32, device=device)
        rows = [[w.data_ptr(), n, k, offsets[i], counters[i]] for i, (w, (n, k)) in
                enumerate(zip(self.weights, shapes, strict=True))]
        rows.append([0, 0, 0, offsets[-1], counters[-1]])
        self.table = torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1)
        self.out = self.acts[offsets[-1]:]

    @property
    def bytes(self) -> int:
        return sum(2 * n * k for n, k in self.shapes)

    def reference(self) -> torch.Tensor:
        """The chain in float32 from the same fp16 weights and input, each output rounded to fp16 as the
        kernel stores it."""
        x = self.acts[: self.shapes[0][1]].float().cpu()
        for w in self.weights:
            x = (w.float().cpu() @ x).half().float()
        return x


def run(kernel, chain: Chain, ctas: int, warps: int, dataflow: int, pdl: int) -> None:
    """The chain once: one launch (`dataflow` 1 or 2, counters zeroed first) or a launch a GEMV."""
    if dataflow:
        chain.counts.zero_()
        kernel(grid=(ctas, 1, 1), block=(32 * warps, 1, 1),
               args=[chain.table, chain.acts, chain.counts, 0, len(chain.shapes)])
        return
    for layer in range(len(chain.shapes)):
        _launch(kernel, ctas, 32 * warps, 0, [chain.table, chain.acts, chain.counts, layer, layer + 1],
                bool(pdl))


def _graph_ms(fn, replays: int = 20) -> float:
    """Median ms of a replay of `fn` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _copy_tbs(device) -> float:
    """Device copy bandwidth (read + write) over 1 GiB, TB/s."""
    a = torch.empty(1 << 29, dtype=torch.int16, device=device)
    b = torch.empty_like(a)
    ms = _graph_ms(lambda: b.copy_(a), 10)
    return 2 * a.numel() * 2 / ms / 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--inner", default="4608,9728",
                   help="a layer's two inner widths a, b: GEMVs hidden→a, a→hidden, hidden→b, b→hidden (the "
                        "27B's row counts; 293 MB of fp16 a layer where a Q4_K layer's four are 215)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--rpw", default="4", help="rows a warp item (comma-separated to sweep)")
    p.add_argument("--unroll", default="4", help="chunks whose weights load ahead (comma-separated)")
    p.add_argument("--warps", type=int, default=8)
    p.add_argument("--min-ctas", type=int, default=2, help="CTAs an SM (the launch bounds and the grid)")
    args = p.parse_args()
    dev = torch.device("cuda")
    h = args.hidden
    a, b = (int(v) for v in args.inner.split(","))
    chain = Chain([(a, h), (h, a), (b, h), (h, b)] * args.layers, dev)
    ref = chain.reference()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ctas = sms * args.min_ctas
    copy = _copy_tbs(dev)
    print(f"{torch.cuda.get_device_name(dev)}: {len(chain.shapes)} GEMVs, {chain.bytes / 1e9:.2f} GB, "
          f"a 1 GiB copy {copy:.2f} TB/s (read + write: a read-only stream may pass it), grid {ctas} × "
          f"{args.warps} warps")
    rows = []
    for rpw in (int(v) for v in args.rpw.split(",")):
        for unroll in (int(v) for v in args.unroll.split(",")):
            forms = {"launches": (0, 0, 0), "launches + PDL": (0, 1, 0),
                     "+ next GEMV's 8 MiB into L2": (0, 2, 0), "one launch, barriers": (2, 0, 0),
                     "dataflow": (1, 0, 0), "one launch, barriers, light sync": (2, 0, 1),
                     "dataflow, light sync": (1, 0, 1)}
            kernels = {}
            for name, (dataflow, pdl, sync) in forms.items():
                kernels[name] = torch.cuda._compile_kernel(
                    source(args.warps, args.min_ctas, rpw, unroll, dataflow, pdl, sync), "chain_gemv")
                chain.acts[chain.shapes[0][1]:].zero_()
                run(kernels[name], chain, ctas, args.warps, dataflow, pdl)
                torch.cuda.synchronize()
                err = ((chain.out.float().cpu() - ref).norm() / ref.norm()).item()
                if not err < 2e-2:
                    raise SystemExit(f"{name} (rpw {rpw}, unroll {unroll}): relative error {err:.2e} against "
                                     "torch")
            times = {name: [] for name in forms}
            for name in list(forms) + list(reversed(forms)):  # A … G G … A
                dataflow, pdl, _ = forms[name]
                times[name].append(_graph_ms(lambda k=kernels[name], d=dataflow, q=pdl:
                                             run(k, chain, ctas, args.warps, d, q)))
            for name in forms:
                ms = min(times[name])
                rows.append((rpw, unroll, name, ms, ms * 1e3 / len(chain.shapes), chain.bytes / ms / 1e9))
    print("\n| rows a warp | chunks ahead | form | ms a chain | µs a GEMV | TB/s |")
    print("|---|---|---|---|---|---|")
    for rpw, unroll, name, ms, us, tbs in rows:
        print(f"| {rpw} | {unroll} | {name} | {ms:.3f} | {us:.2f} | {tbs:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
