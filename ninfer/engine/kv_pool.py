"""The shared paged KV pool: 64-token pages for all lanes, int32 page tables, quantized token rows.

Storage per full-attention layer is one uint8 tensor `[num_pages, kv_heads, PAGE_TOKENS, token_bytes]`
(row layout: `ninfer.kernels.kv_quant`; page layout: docs/engine.md). Page ids are allocated by a pure-Python
`PageAllocator` the scheduler uses for admission; the tensors here are touched only by the runner.
"""

from __future__ import annotations

import torch

from ninfer.engine.cache_spec import CacheSpec
from ninfer.kernels.kv_quant import KvFormat, decode_kv, encode_kv, kv_format

PAGE_TOKENS = 64


def pages_for(tokens: int) -> int:
    return -(-tokens // PAGE_TOKENS)


class PageAllocator:
    """Free list of page ids; no tensors. `reserve` is all-or-nothing."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def can_reserve(self, pages: int) -> bool:
        return pages <= len(self._free)

    def reserve(self, pages: int) -> list[int]:
        if pages > len(self._free):
            raise RuntimeError(f"KV pool has {len(self._free)} free pages, {pages} requested")
        return [self._free.pop() for _ in range(pages)]

    def free(self, page_ids: list[int]) -> None:
        if len(set(page_ids)) != len(page_ids) or len(self._free) + len(page_ids) > self.num_pages:
            raise RuntimeError("KV pool: double free")
        self._free.extend(reversed(page_ids))


class KvPool:
    """Quantized KV rows in pages, one page table row (int32) per lane."""

    def __init__(self, spec: CacheSpec, kv_dtype: str, capacity_tokens: int, max_lanes: int,
                 max_context: int, device: str | torch.device = "cpu"):
        self.spec = spec
        self.fmt: KvFormat = kv_format(kv_dtype, spec.head_dim)
        self.num_pages = pages_for(capacity_tokens)
        self.capacity_tokens = self.num_pages * PAGE_TOKENS
        self.allocator = PageAllocator(self.num_pages)
        self.device = torch.device(device)
        shape = (self.num_pages, spec.kv_heads, PAGE_TOKENS, self.fmt.token_bytes)
        self.storage = [torch.zeros(shape, dtype=torch.uint8, device=self.device)
                        for _ in range(spec.kv_layers)]
        self.max_pages_per_seq = pages_for(max_context)
        # -1 marks an unused entry; a GPU kernel reads rows [lane, : pages_for(len)]
        self.page_tables = torch.full((max_lanes, self.max_pages_per_seq), -1, dtype=torch.int32,
                                      device=device)
        self._lane_pages: dict[int, list[int]] = {}

    # -- accounting ------------------------------------------------------------------------------------------
    @staticmethod
    def bytes_per_token(spec: CacheSpec, kv_dtype: str) -> int:
        """Bytes one token takes over all KV layers and heads."""
        return kv_format(kv_dtype, spec.head_dim).token_bytes * spec.kv_heads * spec.kv_layers

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() for t in self.storage)

    def reserve(self, pages: int) -> list[int]:
        return self.allocator.reserve(pages)

    def free(self, page_ids: list[int]) -> None:
        self.allocator.free(page_ids)

    # -- lanes -----------------------------------------------------------------------------------------------
    def assign(self, lane: int, page_ids: list[int]) -> None:
        """Point lane's page table at already-reserved pages."""
        if len(page_ids) > self.max_pages_per_seq:
            raise RuntimeError(f"{len(page_ids)} pages exceed the page table width {self.max_pages_per_seq}")
        self._lane_pages[lane] = list(page_ids)
        self.page_tables[lane].fill_(-1)
        if page_ids:
            self.page_tables[lane, : len(page_ids)] = torch.tensor(page_ids, dtype=torch.int32)

    def release(self, lane: int) -> list[int]:
        """Forget lane's pages (the caller returns them to the allocator)."""
        self.page_tables[lane].fill_(-1)
        return self._lane_pages.pop(lane, [])

    # -- data ------------------------------------------------------------------------------------------------
    def _locate(self, lane: int, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + count, device=self.device)
        pages = self.page_tables[lane, pos // PAGE_TOKENS].long()
        if (pages < 0).any():
            raise RuntimeError(f"lane {lane}: positions {start}..{start + count - 1} exceed its pages")
        return pages, pos % PAGE_TOKENS

    def write(self, layer: int, lane: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [L, kv_heads, D] (keys unrotated) at positions start..start+L-1 of lane."""
        pages, offsets = self._locate(lane, start, k.shape[0])
        self.storage[layer][pages, :, offsets] = encode_kv(self.fmt, k, v)

    def read(self, layer: int, lane: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """First `tokens` positions of lane as float32 k, v [tokens, kv_heads, D] (k rotated if rk*)."""
        n_pages = pages_for(tokens)
        pages = self.page_tables[lane, :n_pages].long()
        rows = self.storage[layer][pages]  # [P, H, 64, B]
        rows = rows.permute(0, 2, 1, 3).reshape(n_pages * PAGE_TOKENS, self.spec.kv_heads, -1)[:tokens]
        return decode_kv(self.fmt, rows)
