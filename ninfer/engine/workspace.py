"""What serving needs beyond weights, KV pages and GDN slots: measured on CUDA at start (`measure_workspace`).

Before the KV pool is sized, the widest round the scheduler makes (a prefill chunk of `prefill_chunk` tokens
beside `max_concurrency - 1` decode rows) runs eagerly over throwaway pages and state slots: its growth of
the allocator's reserved memory is the activation workspace (with the buffer prefill matmuls make their dense
weight pieces in, which stays). Then every decode graph the engine captures at start (each batch size at each
page-table width of the engine's `max_context`) is captured over the same throwaway pools and dropped: their
private pool's growth is the graphs' plan — measured rather than modelled, since what a pool keeps (each
graph's logits, the deferred GDN state writes of a side stream, the intermediates shared across captures)
lands in the caching allocator's 2 and 20 MiB segments as it packs them (session 73: a model of that packing
planned the synthetic 9B's two widths at 50 MiB; they took 70). The device memory that neither this
process's allocator nor anything else here holds — the CUDA context, other processes — is counted too, and so
is the allocator's slack: free bytes it keeps in segments that also hold live blocks (the weights' loading
leaves them, freed temporaries beside kept tensors), which later small allocations reuse but no KV tensor can
and `empty_cache` cannot hand back (gpu-notes "Session 54": 0.7-0.8 GiB on the synthetic 9B and 27B).
`--kv-capacity auto` leaves all of it, and `--kv-headroom-mib` on top. The rounds and captures double as the
warm-up: the kernels a first request would compile are compiled here. On the CPU nothing is measured
(`CPU_WORKSPACE_BYTES` stands in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ninfer.engine.graphs import DecodeGraphs
from ninfer.engine.kv_pool import PAGE_TOKENS, KvPool, pages_for
from ninfer.engine.runner import ModelRunner
from ninfer.engine.scheduler import Round, WorkItem
from ninfer.engine.state_pool import GdnStatePool
from ninfer.errors import EngineConfigError
from ninfer.kernels.gguf_matmul import release_dense_pieces
from ninfer.models.cache_spec import CacheSpec

CPU_WORKSPACE_BYTES = 256 << 20  # stand-in for activations, logits and allocator slack on CPU


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

    def graphs(self, graphs: DecodeGraphs) -> int: ...

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

    def graphs(self, graphs: DecodeGraphs) -> int:
        """Capture every decode graph the engine captures at start; their private pool's growth."""
        graphs.prepare()
        return graphs.graph_bytes

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
                      prefill_chunk: int, max_context: int, graphs: bool, device: torch.device,
                      meter: Meter | None = None) -> Workspace:
    """Run the widest round over throwaway pools on `device`, then capture the decode graphs over them (page
    tables as wide as `max_context`'s, so the graphs' widths are the engine's); their growth of reserved
    memory (`meter`, CUDA's by default) is the workspace. Token ids are 1..; no pool of the engine's is
    touched."""
    meter = meter or CudaMeter(device)
    first = pages_for(prefill_chunk)  # lane 0's chunk; the others hold one token
    kv = KvPool(spec, kv_dtype, (first + lanes - 1) * PAGE_TOKENS, lanes, max(max_context, prefill_chunk),
                device)
    states = GdnStatePool(spec, lanes, gdn_state_fp16, device)
    runner = ModelRunner(model, kv, states, device)
    admitted = [(lane, kv.reserve(1 if lane else first)) for lane in range(lanes)]
    vocab = int(getattr(model, "vocab_size", 2))
    chunk = tuple(1 + i % (vocab - 1) for i in range(prefill_chunk))
    widest = [WorkItem(None, 0, chunk, 0, True)] + [WorkItem(None, lane, (1,), 0, True)
                                                      for lane in range(1, lanes)]
    decode = None
    try:
        release_dense_pieces()  # a prefill matmul's buffer: the widest round makes it again, measured
        meter.begin()
        runner.run(Round(widest, admitted, []))
        activations = meter.grown()
        planned = 0
        if graphs:
            decode = DecodeGraphs(model, kv, states, log=lambda line: None)
            planned = meter.graphs(decode)
    except torch.OutOfMemoryError as exc:
        raise EngineConfigError(
            f"a round of a {prefill_chunk}-token prefill chunk beside {lanes - 1} decode rows does not fit "
            f"in {device} memory after the weights ({str(exc).splitlines()[0]}); lower --prefill-chunk or "
            "--max-concurrency, or free the GPU") from None
    finally:
        del runner, decode, kv, states  # the graphs and their pool with them
    return Workspace(activations, planned, meter.other(), meter.slack())
