"""What serving needs beyond weights, KV pages and GDN slots: measured on CUDA at start (`measure_workspace`).

Before the KV pool is sized, two rounds run eagerly over throwaway pages and state slots: the widest the
scheduler makes (a prefill chunk of `prefill_chunk` tokens beside `max_concurrency - 1` decode rows) and
one of `max_concurrency` decode rows. The first one's growth of the allocator's reserved memory is the
activation workspace (with the buffer prefill matmuls make their dense weight pieces in, which stays); the
second's, plus the logits each smaller decode graph keeps, plans the decode graphs' memory pool (a captured
round holds what the eager one allocated, the intermediates shared across captures of one pool; with the GDN
state written on a side stream, the widest such capture also keeps every layer's deferred write). The device
memory that neither this process's allocator nor anything else here holds — the CUDA context, other
processes — is counted too, and so is the allocator's slack: free bytes it keeps in segments that also hold
live blocks (the weights' loading leaves them, freed temporaries beside kept tensors), which later small
allocations reuse but no KV tensor can and `empty_cache` cannot hand back (gpu-notes "Session 54": 0.7-0.8
GiB on the synthetic 9B and 27B). `--kv-capacity auto` leaves all of it, and `--kv-headroom-mib` on top. The
rounds double as the warm-up: the kernels a first request would compile are compiled here. On the CPU
nothing is measured (`CPU_WORKSPACE_BYTES` stands in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ninfer.engine.graphs import capture_sizes
from ninfer.engine.kv_pool import PAGE_TOKENS, KvPool, pages_for
from ninfer.engine.runner import ModelRunner
from ninfer.engine.scheduler import Round, WorkItem
from ninfer.engine.state_pool import GdnStatePool
from ninfer.errors import EngineConfigError
from ninfer.kernels.gdn_decode import state_side
from ninfer.kernels.gguf_matmul import release_dense_pieces
from ninfer.models.cache_spec import CacheSpec

CPU_WORKSPACE_BYTES = 256 << 20  # stand-in for activations, logits and allocator slack on CPU
# a private memory pool's first segments beyond its live bytes: PyTorch's caching allocator carves
# allocations of <= 1 MiB from 2 MiB segments and those of 1-10 MiB from 20 MiB ones, per pool
POOL_SEGMENTS = (2 + 20) << 20


@dataclass(frozen=True)
class Workspace:
    activations: int  # the widest round's growth of reserved memory
    graphs: int  # planned for the decode graphs' pool (0 without graphs)
    other: int  # device memory held outside this process's allocator (CUDA context, other processes)
    slack: int = 0  # the allocator's free bytes in segments that also hold live blocks

    @property
    def total(self) -> int:
        return self.activations + self.graphs + self.other + self.slack


class Meter(Protocol):
    def begin(self) -> None: ...

    def grown(self) -> int: ...

    def other(self) -> int: ...

    def slack(self) -> int: ...


class CudaMeter:
    """Growth of the caching allocator's reserved memory from `begin` (its cache emptied) to its peak."""

    def __init__(self, device: torch.device):
        self.device = device
        self._reserved = 0

    def begin(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._reserved = torch.cuda.memory_reserved(self.device)

    def grown(self) -> int:
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.max_memory_reserved(self.device) - self._reserved)

    def other(self) -> int:
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return max(0, total - free - torch.cuda.memory_reserved(self.device))

    def slack(self) -> int:
        torch.cuda.empty_cache()  # hands back the wholly free segments: what stays is beside live blocks
        return torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)


def cpu_workspace() -> Workspace:
    return Workspace(CPU_WORKSPACE_BYTES, 0, 0)


def measure_workspace(model, spec: CacheSpec, *, kv_dtype: str, gdn_state_fp16: bool, lanes: int,
                      prefill_chunk: int, graphs: bool, device: torch.device,
                      meter: Meter | None = None, graph_widths: int = 1) -> Workspace:
    """Run the widest round and a round of `lanes` decode rows over throwaway pools on `device`; their
    growth of reserved memory (`meter`, CUDA's by default) is the workspace, the decode graphs' captured for
    `graph_widths` page-table widths each. Token ids are 1..; no pool of the engine's is touched."""
    meter = meter or CudaMeter(device)
    first = pages_for(prefill_chunk + 1)  # lane 0 decodes after its chunk; the others hold 2 tokens
    kv = KvPool(spec, kv_dtype, (first + lanes - 1) * PAGE_TOKENS, lanes, first * PAGE_TOKENS, device)
    states = GdnStatePool(spec, lanes, gdn_state_fp16, device)
    runner = ModelRunner(model, kv, states, device)
    admitted = [(lane, kv.reserve(1 if lane else first)) for lane in range(lanes)]
    vocab = int(getattr(model, "vocab_size", 2))
    chunk = tuple(1 + i % (vocab - 1) for i in range(prefill_chunk))
    widest = [WorkItem(None, 0, chunk, 0, True)] + [WorkItem(None, lane, (1,), 0, True)
                                                      for lane in range(1, lanes)]
    try:
        release_dense_pieces()  # a prefill matmul's buffer: the widest round makes it again, measured
        meter.begin()
        runner.run(Round(widest, admitted, []))
        activations = meter.grown()
        planned = 0
        if graphs:
            decode = [WorkItem(None, lane, (2,), 1 if lane else prefill_chunk, True) for lane in range(lanes)]
            meter.begin()
            runner.run(Round(decode, [], []))
            # every other graph's fp32 logits and the largest one's padding rows stay in the pool too, and
            # the pool, private, starts its own segments
            sizes = capture_sizes(lanes)
            kept = sizes * graph_widths + [sizes[-1] - lanes]
            kept.remove(sizes[-1])  # the measured round's logits
            planned = meter.grown() + segment_bytes([n * vocab * 4 for n in kept if n]) + POOL_SEGMENTS
            side = [n for n in sizes if n <= state_side()]
            planned += pending_state_bytes(spec, side[-1]) if side else 0
    except torch.OutOfMemoryError as exc:
        raise EngineConfigError(
            f"a round of a {prefill_chunk}-token prefill chunk beside {lanes - 1} decode rows does not fit "
            f"in {device} memory after the weights ({str(exc).splitlines()[0]}); lower --prefill-chunk or "
            "--max-concurrency, or free the GPU") from None
    finally:
        del runner, kv, states
    return Workspace(activations, planned, meter.other(), meter.slack())


def segment_bytes(blocks: list[int]) -> int:
    """The caching allocator's segments that blocks of these sizes, kept together, take: those of ≤ 1 MiB
    come from 2 MiB segments, those up to 10 MiB from 20 MiB ones (largest first, each into the first that
    has room), larger ones from a segment each of their size rounded up to 2 MiB — so three widths' graphs'
    logits of the 27B (1.9-7.6 MiB each) take whole 20 MiB segments, more than their bytes."""
    total, small, free = 0, 0, []
    for size in sorted(blocks, reverse=True):
        size = -(-size // 512) * 512
        if size <= 1 << 20:
            small += size
        elif size <= 10 << 20:
            room = next((i for i, left in enumerate(free) if left >= size), None)
            if room is None:
                free.append(20 << 20)
                total, room = total + (20 << 20), len(free) - 1
            free[room] -= size
        else:
            total += -(-size // (2 << 20)) * (2 << 20)
    return total + -(-small // (2 << 20)) * (2 << 20)


def pending_state_bytes(spec: CacheSpec, lanes: int) -> int:
    """The deferred GDN state writes a capture of `lanes` rows keeps to its end when they run on a side
    stream (graphs of at most `gdn_decode.state_side()` rows): every GDN layer's k, δ and decay in fp32,
    which the allocator cannot reuse before the capture ends since another stream reads them."""
    per_lane = spec.gdn_key_heads * spec.gdn_key_dim + 2 * spec.gdn_value_heads * spec.gdn_value_dim
    return spec.num_gdn_layers * lanes * per_lane * 4
