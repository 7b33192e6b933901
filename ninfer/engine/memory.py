"""The memory plan: the device budget, `--kv-capacity auto`, and the ledger of where memory went.

On CUDA the budget is the GPU's memory (or `--gpu-memory-limit-mib`); the workspace, the decode graphs' pool
and the memory held outside this process's allocator are measured at start (`engine.workspace`). On CPU the
budget is the machine's RAM (or the same flag, as a RAM budget) and the workspace a stand-in; there `auto` is
also capped at max_concurrency x max_context tokens, since a CPU pool larger than every lane can use is only
wasted RAM.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch

from ninfer.engine.kv_pool import PAGE_TOKENS, KvPool
from ninfer.engine.state_pool import GdnStatePool
from ninfer.errors import EngineConfigError
from ninfer.models.cache_spec import CacheSpec

MIB = 1 << 20
GIB = 1 << 30


def device_budget_bytes(device: str, limit_mib: int | None) -> int:
    if limit_mib is not None:
        return limit_mib * MIB
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # Windows: no sysconf
        return 16 * GIB


def module_bytes(model: object) -> int:
    """Bytes of a model's parameters and buffers (each storage counted once)."""
    seen, total = set(), 0
    tensors = []
    if isinstance(model, torch.nn.Module):
        tensors = list(model.parameters()) + list(model.buffers())
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += key[1]
    return total


def stored_weight_bytes(source: object, prefix: str = "text/") -> int | None:
    """Bytes of the stored tensors a text model loads from `source` (each stored object once): the
    denominator of the weights-on-device check (issue 5: device bytes <= 1.03x). None when unknown."""
    if hasattr(source, "stored_bytes"):  # the synthetic source
        return int(source.stored_bytes())
    bindings, info = getattr(source, "bindings", None), getattr(source, "object_info", None)
    if not isinstance(bindings, dict) or info is None:
        return None
    objects = {part["object"] for name, binding in bindings.items() if name.startswith(prefix)
               for part in ([binding] if "object" in binding else binding["parts"])}
    return sum(int(info(o)["bytes"]) for o in objects)


def weights_ratio(device_bytes: int, stored_bytes: int | None) -> float | None:
    """Weights on the device per stored byte (1.0: held exactly as stored; ~3.5 for q4_k held as bf16)."""
    return None if not stored_bytes else device_bytes / stored_bytes


@dataclass(frozen=True)
class MemoryLedger:
    device: str
    budget_bytes: int
    weights_bytes: int
    kv_tokens: int
    kv_dtype: str
    kv_bytes: int
    gdn_slots: int
    gdn_bytes: int
    workspace_bytes: int  # activations of the widest round (measured on CUDA)
    graphs_planned_bytes: int = 0  # set aside for the decode graphs' pool
    graphs_bytes: int = 0  # the decode graphs' pool as captured so far
    other_bytes: int = 0  # held outside this process's allocator: the CUDA context, other processes
    slack_bytes: int = 0  # the allocator's free bytes beside live blocks (workspace.Workspace.slack)

    @property
    def held_bytes(self) -> int:
        """What this process plans to hold: weights, KV, GDN slots, workspace, the allocator's slack, graphs
        (captured or plan)."""
        return (self.weights_bytes + self.kv_bytes + self.gdn_bytes + self.workspace_bytes + self.slack_bytes
                + max(self.graphs_bytes, self.graphs_planned_bytes))

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.held_bytes - self.other_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "free_bytes": self.free_bytes}

    def line(self) -> str:
        """e.g. `weights 10.2 GiB · KV 210,048 tokens (rk8v4) 6.56 GiB · GDN 2 slots 150 MiB · ...`."""
        return (f"memory ({self.device}, budget {_fmt(self.budget_bytes)}): "
                f"weights {_fmt(self.weights_bytes)} · "
                f"KV {self.kv_tokens:,} tokens ({self.kv_dtype}) {_fmt(self.kv_bytes)} · "
                f"GDN {self.gdn_slots} slots {_fmt(self.gdn_bytes)} · "
                f"workspace {_fmt(self.workspace_bytes)} · "
                f"slack {_fmt(self.slack_bytes)} · "
                f"graphs {_fmt(self.graphs_bytes)} of {_fmt(self.graphs_planned_bytes)} planned · "
                f"other {_fmt(self.other_bytes)} · "
                f"free {_fmt(self.free_bytes)}")


def _fmt(n: int) -> str:
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / MIB:.0f} MiB"


def plan_kv_capacity(requested: int | str, *, spec: CacheSpec, kv_dtype: str, device: str, budget_bytes: int,
                     weights_bytes: int, gdn_bytes: int, workspace_bytes: int, headroom_mib: int,
                     max_context: int, max_concurrency: int) -> int:
    """Tokens of KV pool to allocate (a multiple of the page size), checked against max_context;
    `workspace_bytes`: everything else serving needs (`Workspace.total`)."""
    per_token = max(KvPool.bytes_per_token(spec, kv_dtype), 1)
    if requested == "auto":
        free = budget_bytes - weights_bytes - gdn_bytes - workspace_bytes - headroom_mib * MIB
        tokens = max(free, 0) // per_token // PAGE_TOKENS * PAGE_TOKENS
        if not device.startswith("cuda"):
            cap = -(-max_context * max_concurrency // PAGE_TOKENS) * PAGE_TOKENS
            tokens = min(tokens, cap)
        if tokens < max_context:
            raise EngineConfigError(
                f"--kv-capacity auto: only {tokens:,} tokens of {kv_dtype} KV fit after weights "
                f"({weights_bytes / GIB:.2f} GiB), {workspace_bytes / MIB:,.0f} MiB of workspace and "
                f"{headroom_mib} MiB headroom, fewer than --max-context "
                f"{max_context:,}; lower --max-context, pick a smaller --kv-dtype, or raise "
                "--gpu-memory-limit-mib")
        return tokens
    tokens = int(requested)
    if tokens < max_context:
        raise EngineConfigError(f"--kv-capacity {tokens:,} is smaller than --max-context {max_context:,}; "
                                "raise --kv-capacity (or use auto) or lower --max-context")
    return -(-tokens // PAGE_TOKENS) * PAGE_TOKENS


def build_ledger(device: str, budget_bytes: int, weights_bytes: int, kv: KvPool, states: GdnStatePool,
                 kv_dtype: str, workspace) -> MemoryLedger:
    """`workspace`: an `engine.workspace.Workspace`."""
    return MemoryLedger(device, budget_bytes, weights_bytes, kv.capacity_tokens, kv_dtype, kv.total_bytes,
                        states.slots, states.total_bytes, workspace.activations, workspace.graphs, 0,
                        workspace.other, workspace.slack)
