"""The shared paged KV pool: 64-token pages for all lanes, int32 page tables, quantized token rows.

Storage per full-attention layer is one uint8 tensor `[num_pages, kv_heads, PAGE_TOKENS, token_bytes]`
(row layout: `ninfer.kernels.kv_quant`; page layout: docs/engine.md). Page ids are allocated by a pure-Python
`PageAllocator` the scheduler uses for admission; the tensors here are touched only by the runner.
"""

from __future__ import annotations

import torch

from ninfer.kernels.kv_quant import KvFormat, decode_kv, encode_kv, kv_format
from ninfer.kernels.kv_write import kernel_writes, write_kv
from ninfer.models.cache_spec import CacheSpec

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
        # one page past the allocator's and one page-table row past the lanes: the scratch lane that pads
        # a CUDA-graph decode batch to its captured size (its results are dropped; it owns nothing else)
        self.scratch_page, self.scratch_lane = self.num_pages, max_lanes
        shape = (self.num_pages + 1, spec.kv_heads, PAGE_TOKENS, self.fmt.token_bytes)
        self.storage = [torch.zeros(shape, dtype=torch.uint8, device=self.device)
                        for _ in range(spec.total_kv_layers)]
        self.max_pages_per_seq = pages_for(max_context)
        # -1 marks an unused entry; a GPU kernel reads rows [lane, : pages_for(len)]
        self.page_tables = torch.full((max_lanes + 1, self.max_pages_per_seq), -1, dtype=torch.int32,
                                      device=device)
        self.page_tables[self.scratch_lane, 0] = self.scratch_page
        self._lane_pages: dict[int, list[int]] = {}

    # -- accounting ------------------------------------------------------------------------------------------
    @staticmethod
    def bytes_per_token(spec: CacheSpec, kv_dtype: str) -> int:
        """Bytes one token takes over all KV layers and heads."""
        return kv_format(kv_dtype, spec.head_dim).token_bytes * spec.kv_heads * spec.total_kv_layers

    @property
    def total_bytes(self) -> int:
        """Bytes of the lanes' pages (the scratch page adds one page more per layer)."""
        return sum(t[: self.num_pages].numel() for t in self.storage)

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
    def locate(self, lane: int, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(page ids, in-page offsets) of positions start..start+count-1 of lane (the same in every layer)."""
        lane_pages = self._lane_pages.get(lane, [])
        if start + count > len(lane_pages) * PAGE_TOKENS:
            raise RuntimeError(f"lane {lane}: positions {start}..{start + count - 1} exceed its pages")
        pos = torch.arange(start, start + count, device=self.device)
        return self.page_tables[lane, pos // PAGE_TOKENS].long(), pos % PAGE_TOKENS

    def page_index(self, lane: int, tokens: int) -> torch.Tensor:
        """Page ids holding the first `tokens` positions of lane."""
        return self.page_tables[lane, : pages_for(tokens)].long()

    def write(self, layer: int, where: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store k, v [L, kv_heads, D] (keys unrotated) at `where` (from `locate`)."""
        pages, offsets = where
        storage = self.storage[layer]
        if kernel_writes(self.fmt, storage):  # one launch: encoded and stored in place
            write_kv(storage, pages, offsets, k, v, self.fmt)
        else:
            storage[pages, :, offsets] = encode_kv(self.fmt, k, v)

    def read(self, layer: int, pages: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions 0..tokens-1 held in `pages` (from `page_index`) as float32 k, v [kv_heads, tokens, D]
        (k rotated for rk* dtypes)."""
        rows = self.storage[layer][pages]  # [P, H, 64, B]
        rows = rows.transpose(0, 1).reshape(self.spec.kv_heads, -1, rows.shape[-1])[:, :tokens]
        return decode_kv(self.fmt, rows)
