"""The runner owns the tensors (model, KV pool, GDN state slots) and runs one round as one forward."""

from __future__ import annotations

import torch

from ninfer.engine.gdn_mix import SHORT_SPAN
from ninfer.engine.graphs import DecodeGraphs
from ninfer.engine.kv_pool import KvPool
from ninfer.engine.paged_context import PagedBatchContext
from ninfer.engine.scheduler import Round
from ninfer.engine.state_pool import GdnStatePool
from ninfer.models.context import SequenceSpan


class ModelRunner:
    def __init__(self, model, kv: KvPool, states: GdnStatePool, device: str | torch.device = "cpu",
                 decode_graphs: bool = False):
        self.model = model
        self.kv = kv
        self.states = states
        self.device = torch.device(device)
        self.batched_decode: bool | None = None  # None: the paged decode kernel on CUDA only
        self.gdn_kernels: bool | None = None  # None: GDN mixing on the kernels on CUDA only
        # rounds of one-token decode items through DecodeGraphs (captured on CUDA, eager elsewhere)
        self.graphs = DecodeGraphs(model, kv, states) if decode_graphs else None
        self._graph_ids: tuple[torch.Tensor, torch.Tensor] | None = None  # (the logits run gave, argmax)

    def install(self, rnd: Round) -> None:
        """Apply the scheduler's lane changes: forget released lanes, map and zero admitted ones."""
        for lane in rnd.released:
            self.kv.release(lane)
        for lane, pages in rnd.admitted:
            self.kv.assign(lane, pages)
            self.states.reset(lane)

    @staticmethod
    def _graph_shape(rnd: Round, all_rows: bool) -> bool:
        """Rounds the decode graphs take: every item samples and has the same T ≤ SHORT_SPAN tokens (T = 1:
        decode; T > 1: verification, all rows wanted)."""
        T = len(rnd.items[0].token_ids)
        return T <= SHORT_SPAN and (T == 1 or all_rows) and all(
            it.sample and len(it.token_ids) == T for it in rnd.items)

    @torch.inference_mode()
    def run(self, rnd: Round, all_rows: bool = False, device_ids: torch.Tensor | None = None
            ) -> torch.Tensor | None:
        """Forward every item of the round; returns fp32 logits [n_sampled, vocab] in item order
        (with `all_rows`, logits of every row of the batch: perplexity), valid until the next round runs
        (a decode graph's static output). `device_ids`: the items' tokens in
        row order, already on the device (a decode round launched before the tokens that feed it reached the
        host); the items' `token_ids` then only give their lengths."""
        self.install(rnd)
        self._graph_ids = None
        if not rnd.items:
            return None
        if self.graphs is not None and self._graph_shape(rnd, all_rows):
            items = rnd.items
            logits = self.graphs.run_spans([it.lane for it in items], [list(it.token_ids) for it in items],
                                           [it.start for it in items], device_ids)
            if self.graphs.ids is not None:  # one token an item, or all rows: every row's
                self._graph_ids = (logits, self.graphs.ids)
            return logits
        ids, positions, spans, last_rows = [], [], [], []
        row = 0
        for item in rnd.items:
            n = len(item.token_ids)
            spans.append(SequenceSpan(row, n, item.start, item.lane))
            ids.extend(item.token_ids)
            positions.extend(range(item.start, item.start + n))
            if item.sample:
                last_rows.append(row + n - 1)
            row += n
        ctx = PagedBatchContext(spans, self.kv, self.states, self.batched_decode, self.gdn_kernels)
        input_ids = device_ids if device_ids is not None else torch.tensor(ids, dtype=torch.long,
                                                                            device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model.forward(input_ids, pos, ctx)
        ctx.commit_states()
        if all_rows:
            return self.model.compute_logits(hidden).float()
        if not last_rows:
            return None
        return self.model.compute_logits(hidden[torch.tensor(last_rows, device=self.device)]).float()

    def greedy_ids(self, logits: torch.Tensor, vocab: int | None) -> torch.Tensor:
        """Each row's argmax over the first `vocab` columns of `logits` (None: all), on the device: where
        `logits` is what the last `run` returned from a decode graph, the graph's own (no launch now)."""
        if self._graph_ids is not None and self._graph_ids[0] is logits and self.graphs.vocab == vocab:
            return self._graph_ids[1]
        return logits[:, :vocab].argmax(dim=-1)
