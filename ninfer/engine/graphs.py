"""Decode rounds as CUDA graphs: one captured forward (embedding → layers → norm → logits) per batch shape.

A round of B decode items of T tokens each (T = 1: plain decode; 2..SHORT_SPAN: the verification shape of
speculative decoding, logits of every position) replays the graph of (the smallest captured size ≥ B, T, the
narrowest page-table width its items end within: `GRAPH_WIDTHS`) (sizes 1, 2, 4, 8, then multiples of 8),
padded with the scratch lane (`KvPool.scratch_lane`, `GdnStatePool.scratch_slot`) whose rows are dropped. A
graph ends with its rows' fp32 logits and their argmax below the sample vocab (`ops.logits_argmax`: a greedy
round's tokens need no launch after it). Everything a round changes (token ids, positions, lanes, lengths, GDN
slots) lives in static device tensors filled by one host-to-device copy before `replay()`; the captured region
never reads a tensor on the host. The same `GraphDecodeContext` runs eagerly where nothing is captured (CPU),
which is how the CPU tests check it against `PagedBatchContext`. The engine captures every size's one-token
graph at start (`prepare`); verification shapes on first use.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass

import torch

from ninfer.engine.gdn_mix import SHORT_SPAN, decode_conv, decode_mix
from ninfer.engine.kv_pool import PAGE_TOKENS, KvPool, pages_for
from ninfer.engine.state_pool import GdnStatePool
from ninfer.kernels.gdn_decode import ConvEpilogue, gdn_decode, state_side
from ninfer.kernels.kv_write import decode_rows
from ninfer.kernels.ops import logits_argmax
from ninfer.kernels.paged_attention import paged_decode_attention
from ninfer.models.context import GdnState, SequenceSpan

# rows of the static input block: token id, position, lane (page-table row), sequence length, GDN slot
_IDS, _POS, _LANE, _LEN, _SLOT = range(5)
# Page-table widths (pages) below the pool's own for which each decode shape gets graphs of its own: a round
# whose items all end within a width replays the narrowest such graph, whose decode attention splits the
# context over that width (`paged_attention.decode_splits`) rather than the server's whole max context — a
# 16K-token table gives a lone 512-token chat 64 splits a KV head, 5 of them with pages. Session 72 (H100,
# `bench/tg_engine.py`, Q4_K tg128 under the suite's 8-lane 16,576-token engine): 164.53 → 164.95 tok/s with
# 16 / 64 (the plain bench's 1-lane 640-token engine 165.51). NINFER_GRAPH_WIDTHS=16,64 (pages; empty: none).
GRAPH_WIDTHS: tuple[int, ...] = (16, 64)


def graph_widths(full: int) -> list[int]:
    """The page-table widths decode graphs are captured for, narrowest first, ending with `full` (the pool's
    width): `GRAPH_WIDTHS` below it, or NINFER_GRAPH_WIDTHS's."""
    forced = os.environ.get("NINFER_GRAPH_WIDTHS")
    widths = GRAPH_WIDTHS if forced is None else tuple(int(w) for w in forced.split(",") if w.strip())
    return sorted({w for w in widths if 0 < w < full} | {full})


def capture_sizes(max_lanes: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to the first size ≥ max_lanes."""
    sizes, n = [], 1
    while not sizes or sizes[-1] < max_lanes:
        sizes.append(n)
        n = n * 2 if n < 8 else n + 8
    return sizes


class GraphDecodeContext:
    """BatchContext of B spans of T tokens whose addresses are device tensors (static across replays).

    `inputs` is a `[5, B·T]` int64 block (see `_IDS`...), lane-major (the T rows of a lane are adjacent).
    `begin()` computes the KV write slots from the page tables on the device; attention writes the k/v of
    every row with tensor indexing, then runs `paged_decode_attention` with one query row per position whose
    length stops at itself (causal inside the span); GDN layers mix through `gdn_decode` (T positions per
    lane) with the slot tensor. No host synchronisation anywhere.
    """

    def __init__(self, inputs: torch.Tensor, kv: KvPool, states: GdnStatePool, positions: int = 1,
                 width: int | None = None, state_side: bool = False):
        self.inputs = inputs
        self.positions = positions
        # the attention's view of the page tables: every row's sequence ends within its first `width` pages
        self.page_tables = kv.page_tables if width is None else kv.page_tables[:, :width]
        self._kv = kv
        self._states = states
        # rows only (lanes and lengths are tensors): the GDN hook means no model reads them
        self.spans = [SequenceSpan(i, 1, 0, -1) for i in range(inputs.shape[1])]
        self._write_pages = self._write_offsets = self._lane_slots = None
        self._lanes = self._lens = None
        # one-position rounds: the recurrent states' writes on a stream of their own
        # (`gdn_decode.state_side`), joined in `end`
        self._side = torch.cuda.Stream(kv.device) if state_side and positions == 1 else None

    @property
    def batch(self) -> int:
        return self.inputs.shape[1] // self.positions

    def begin(self) -> None:
        """Per forward, on the device (one launch on CUDA, `kv_write.decode_rows`): page id and in-page row of
        every new token; each lane's GDN slot; the rows' lanes and lengths as the attention kernels take them
        (int32: converted once, not in every attention layer)."""
        (self._write_pages, self._write_offsets, self._lanes, self._lens,
         self._lane_slots) = decode_rows(self.inputs, self._kv.page_tables, self.positions)

    def end(self) -> None:
        """Per forward, after its last kernel: the GDN state writes left on the side stream joined to it."""
        if self._side is not None:
            torch.cuda.current_stream(self._side.device).wait_stream(self._side)

    def attention(self, kv_layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.gated_attention(kv_layer, q, k, v, None)

    def gated_attention(self, kv_layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        gate: torch.Tensor | None, group: int = 32) -> torch.Tensor:
        """`attention` times its output gate, `[T, Hq·D]`, the gate applied in the attention's last launch
        (the optional hook of `models.qwen3_5.GatedAttention`; `group`: the output Linear's int8 activation
        grouping); no gate: `attention`'s `[T, Hq, D]`."""
        self._kv.write(kv_layer, (self._write_pages, self._write_offsets), k, v)
        return paged_decode_attention(q, self._kv.storage[kv_layer], self.page_tables, self._lanes,
                                      self._lens, self._kv.fmt, gate=gate, group=group)

    def gdn_mix(self, gdn_layer: int, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                params, conv_done: bool = False) -> torch.Tensor:
        if self.positions == 1:
            return decode_mix(self._states, gdn_layer, mixed_qkv, a, b, params, self._lane_slots, conv_done,
                              self._side)
        shape = (self.batch, self.positions)
        out = gdn_decode(mixed_qkv.unflatten(0, shape), a.unflatten(0, shape), b.unflatten(0, shape),
                         params.conv_weight, params.a_log, params.dt_bias, self._states.conv[gdn_layer],
                         self._states.recurrent[gdn_layer], self._lane_slots, params.num_key_heads,
                         conv_done=conv_done).output
        return out.flatten(0, 1)

    def gdn_conv(self, gdn_layer: int, params) -> ConvEpilogue | None:
        """The decode conv for the input projection to run (`models.qwen3_5.GdnParams`) over the round's T
        positions a lane (the rows kernels run it at one, the il32 and q4il ones at up to 8 columns)."""
        return decode_conv(self._states, gdn_layer, params, self._lane_slots, self.positions)

    def gdn_state(self, gdn_layer: int, span_index: int) -> GdnState:
        raise RuntimeError("GraphDecodeContext mixes GDN layers through gdn_mix; a model asked for gdn_state")


@dataclass
class _Captured:
    graph: object | None  # torch.cuda.CUDAGraph, or None when run eagerly
    ctx: GraphDecodeContext
    logits: torch.Tensor | None  # the graph's static output [size, vocab]
    ids: torch.Tensor | None = None  # and each row's argmax below DecodeGraphs.vocab [size]


@dataclass(frozen=True)
class CaptureRecord:
    batch: int
    seconds: float
    pool_bytes: int  # growth of the shared graph memory pool (reserved bytes) during this capture
    positions: int = 1
    context: int = 0  # tokens its page-table view covers

    def line(self) -> str:
        shape = f"{self.batch}" if self.positions == 1 else f"{self.batch} x {self.positions} positions"
        return (f"cuda graph: decode batch {shape} up to {self.context:,} tokens captured in "
                f"{self.seconds:.2f} s, graph pool +{self.pool_bytes / 2**20:.0f} MiB")


class DecodeGraphs:
    """The runner's decode path for rounds of B items of T ≤ SHORT_SPAN tokens each: captured graphs on CUDA,
    eager elsewhere."""

    def __init__(self, model, kv: KvPool, states: GdnStatePool, capture: bool | None = None, log=None):
        self.model = model
        self.kv = kv
        self.states = states
        self.capture = kv.device.type == "cuda" if capture is None else capture
        self.sizes = capture_sizes(kv.scratch_lane)  # scratch_lane == max lanes
        self.widths = graph_widths(kv.page_tables.shape[1])
        pin = kv.device.type == "cuda"
        self._host = torch.zeros(5 * self.sizes[-1] * SHORT_SPAN, dtype=torch.long, pin_memory=pin)
        with self._on_device():
            self._copied = torch.cuda.Event() if pin else None  # the last staged copy left the pinned buffer
        self._padding = (0, 0, kv.scratch_lane, 1, states.scratch_slot)
        self.vocab: int | None = None  # the argmax's columns (`prepare`; None: all)
        self.ids: torch.Tensor | None = None  # the last round's argmax (`run_spans`)
        self._graphs: dict[tuple[int, int, int], _Captured] = {}  # (batch, positions, width)
        self._pool = None
        self.records: list[CaptureRecord] = []
        self._log = log if log is not None else (lambda line: print(line, file=sys.stderr))

    def _on_device(self):
        """Streams, events and graphs of the pools' GPU (which need not be the current device)."""
        on_gpu = self.kv.device.type == "cuda"
        return torch.cuda.device(self.kv.device) if on_gpu else contextlib.nullcontext()

    def prepare(self, vocab: int | None = None) -> None:
        """Build (on CUDA: capture) the one-token graph of every batch size now, as the engine does at start,
        so no decode round waits on a capture and the memory ledger shows the graphs' pool from the start;
        their argmax over the first `vocab` logit columns (None: all)."""
        if self._graphs and vocab != self.vocab:
            raise ValueError(f"decode graphs captured with an argmax over {self.vocab} columns, "
                             f"asked for {vocab}")
        self.vocab = vocab
        with self._on_device():
            for width in self.widths:
                for n in self.sizes:
                    if (n, 1, width) not in self._graphs:
                        self._build(n, 1, width)

    def clear(self) -> None:
        """Drop every graph, to be captured again on use (under another launch setting: `bench/`'s sweeps),
        with the last round's argmax; later captures take a new memory pool, since a tensor of the old one
        may outlive its graphs (the caller's logits) and torch asserts on capturing into a pool whose graphs
        are all gone while its memory is not."""
        self._graphs.clear()
        self.records.clear()
        self.ids = None
        self._pool = None

    def padded_size(self, batch: int) -> int:
        return next(s for s in self.sizes if s >= batch)

    @property
    def graph_bytes(self) -> int:
        return sum(r.pool_bytes for r in self.records)

    def run(self, lanes: list[int], token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """Logits fp32 `[B, vocab]` of B one-token decode items (lane, token at position)."""
        return self.run_spans(lanes, [[t] for t in token_ids], positions)

    def run_spans(self, lanes: list[int], token_ids: list[list[int]], starts: list[int],
                  device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits fp32 `[B·T, vocab]` (lane-major) of B items of T tokens each (lane, tokens from start);
        `device_ids` (`[B·T]` on the pools' device): the tokens themselves, `token_ids` then only give T.
        Captured: a view of the graph's static output, valid until that graph's next replay (every caller
        reads it first: argmax queued on the stream, or copied to the host), no copy of the logits a round.
        `self.ids` is then the rows' argmax below `vocab`, as long-lived."""
        B, T = len(lanes), len(token_ids[0])
        n = self.padded_size(B)
        rows = [[t for ids in token_ids for t in ids], [p for s in starts for p in range(s, s + T)],
                [lane for lane in lanes for _ in range(T)]]
        rows += [[p + 1 for p in rows[1]], rows[2]]
        with self._on_device():
            entry = self.entry(n, T, max(starts, default=0) + T)
            self._stage(entry.ctx.inputs, rows)
            if device_ids is not None:  # in stream order after the staged copy, before the replay
                entry.ctx.inputs[_IDS, : B * T].copy_(device_ids)
            if entry.graph is None:
                logits, ids = self._forward(entry.ctx)
            else:
                entry.graph.replay()
                logits, ids = entry.logits, entry.ids
            self.ids = ids[: B * T] if ids is not None else None
            return logits[: B * T]

    def _stage(self, inputs: torch.Tensor, rows: list[list[int]]) -> None:
        """One host-to-device copy of a round's inputs into a graph's static `[5, n]` block (padding rows
        point at the scratch lane), from a pinned buffer on CUDA."""
        n, B = inputs.shape[1], len(rows[0])
        if self._copied is not None:
            self._copied.synchronize()
        host = self._host[: 5 * n].view(5, n)
        if B:
            host[:, :B] = torch.tensor(rows, dtype=torch.long)
        for r, value in enumerate(self._padding):
            host[r, B:] = value
        inputs.copy_(host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _forward(self, ctx: GraphDecodeContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 logits of the block's rows and their argmax below `vocab` (None with NINFER_GRAPH_ARGMAX=0:
        the engine's argmax after the graph)."""
        with torch.inference_mode():
            ctx.begin()
            hidden = self.model.forward(ctx.inputs[_IDS], ctx.inputs[_POS], ctx)
            logits = self.model.compute_logits(hidden)
            if os.environ.get("NINFER_GRAPH_ARGMAX") == "0":  # A/B: the argmax after the graph, as before
                out = logits.float(), None
            else:
                out = logits_argmax(logits, self.vocab)
            ctx.end()
            return out

    def entry(self, n: int, positions: int, tokens: int) -> _Captured:
        """The graph of n items of `positions` tokens whose sequences end within `tokens` tokens: of the
        narrowest page-table width they fit (built, on CUDA captured, on first use)."""
        width = next((w for w in self.widths if w >= pages_for(tokens)), self.widths[-1])
        return self._graphs.get((n, positions, width)) or self._build(n, positions, width)

    def _build(self, n: int, positions: int, width: int) -> _Captured:
        # graphs of at most `state_side()` lanes write the GDN states on a side stream (read at each capture,
        # so a sweep's `clear` takes a new setting)
        side = self.kv.device.type == "cuda" and n <= state_side()
        ctx = GraphDecodeContext(torch.zeros(5, n * positions, dtype=torch.long, device=self.kv.device),
                                 self.kv, self.states, positions, width, side)
        entry = _Captured(None, ctx, None)
        if self.capture:
            try:
                entry = self._capture(n, ctx)
            except RuntimeError as exc:  # an op that cannot be captured: keep serving, eagerly, and say so
                self._log(f"cuda graph: capture of decode batch {n}x{positions} failed "
                          f"({str(exc).splitlines()[0]}); decode rounds run eagerly from now on")
                self.capture = False
        self._graphs[n, positions, width] = entry
        return entry

    def _capture(self, n: int, ctx: GraphDecodeContext) -> _Captured:
        """The torch recipe: warm-up on a side stream, then capture into the shared pool. Warm-up and capture
        run on the scratch lane only, so no real lane's KV or state moves; the round's inputs go in after."""
        started = time.perf_counter()
        self._stage(ctx.inputs, [[] for _ in range(5)])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(ctx)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        torch.cuda.empty_cache()  # as torch.cuda.graph does on entry: the growth measured is then the pool's
        before = torch.cuda.memory_reserved(self.kv.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, ids = self._forward(ctx)
        torch.cuda.synchronize()
        grown = torch.cuda.memory_reserved(self.kv.device) - before
        record = CaptureRecord(n, time.perf_counter() - started, grown, ctx.positions,
                               ctx.page_tables.shape[1] * PAGE_TOKENS)
        self.records.append(record)
        self._log(record.line())
        return _Captured(graph, ctx, logits, ids)
