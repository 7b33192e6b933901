"""Test-only model drivers: a BatchContext over contiguous per-sequence caches, greedy generation, and
a weight source reading the fixture's HF safetensors under ninfer's logical names.

The engine's paged context replaces `SimpleContext`; this one is deliberately plain so model tests do
not depend on the KV pool.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ninfer.kernels.reference import attention_reference
from ninfer.models.cache_spec import CacheSpec
from ninfer.models.context import GdnState, SequenceSpan


@contextmanager
def single_thread() -> Iterator[None]:
    """Run torch on one thread: on this shared 2-core machine, intra-op threads spinning against other
    processes made the tiny model's matmuls ~40x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class SequenceCache:
    """One sequence's KV (fp32 lists per layer) and GDN state."""

    def __init__(self, spec: CacheSpec, dtype: torch.dtype = torch.float32, mtp: bool = False):
        n_kv = spec.total_kv_layers if mtp else spec.num_kv_layers
        self.keys: list[torch.Tensor | None] = [None] * n_kv
        self.values: list[torch.Tensor | None] = [None] * n_kv
        self.gdn = [
            GdnState(conv=torch.zeros(spec.conv_state_shape, dtype=dtype),
                     recurrent=torch.zeros(spec.recurrent_state_shape, dtype=torch.float32))
            for _ in range(spec.num_gdn_layers)
        ]

    def length(self, kv_layer: int) -> int:
        k = self.keys[kv_layer]
        return 0 if k is None else k.shape[0]


class SimpleContext:
    """BatchContext for a list of (cache, new-token count) sequences flattened in order."""

    def __init__(self, caches: list[SequenceCache], lengths: list[int], cached: list[int]):
        self.caches = caches
        self.spans: list[SequenceSpan] = []
        start = 0
        for slot, (n, c) in enumerate(zip(lengths, cached, strict=True)):
            self.spans.append(SequenceSpan(start=start, length=n, cached_tokens=c, slot=slot))
            start += n

    def attention(self, kv_layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        for span in self.spans:
            cache = self.caches[span.slot]
            rows = slice(span.start, span.start + span.length)
            assert cache.length(kv_layer) == span.cached_tokens, "cache and span disagree"
            old_k, old_v = cache.keys[kv_layer], cache.values[kv_layer]
            keys = k[rows] if old_k is None else torch.cat([old_k, k[rows]])
            values = v[rows] if old_v is None else torch.cat([old_v, v[rows]])
            cache.keys[kv_layer], cache.values[kv_layer] = keys, values
            out[rows] = attention_reference(q[rows], keys, values, causal_offset=span.cached_tokens)
        return out

    def gdn_state(self, gdn_layer: int, span_index: int) -> GdnState:
        return self.caches[self.spans[span_index].slot].gdn[gdn_layer]


@dataclass
class Sequence:
    """A token history plus its cache, for driving a model step by step in tests."""

    cache: SequenceCache
    tokens: list[int]
    done: int = 0  # tokens already run through the model


def step(model, seqs: list[Sequence], counts: list[int]) -> torch.Tensor:
    """Run the next `counts[i]` tokens of each sequence in one flat batch; returns hidden [T, H]."""
    ids, pos = [], []
    for s, n in zip(seqs, counts, strict=True):
        ids += s.tokens[s.done : s.done + n]
        pos += list(range(s.done, s.done + n))
    ctx = SimpleContext([s.cache for s in seqs], counts, [s.done for s in seqs])
    hidden = model.forward(torch.tensor(ids), torch.tensor(pos), ctx)
    for s, n in zip(seqs, counts, strict=True):
        s.done += n
    return hidden


def prefill_logits(model, ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """All-position logits of one prompt, run in chunks of `chunk` tokens (None: whole)."""
    seq = Sequence(SequenceCache(model.cache_spec), list(ids))
    chunk = chunk or len(ids)
    outs = []
    while seq.done < len(ids):
        outs.append(model.compute_logits(step(model, [seq], [min(chunk, len(ids) - seq.done)])))
    return torch.cat(outs)


def greedy(model, ids: list[int], n_new: int) -> list[int]:
    """Prefill then `n_new` one-token decode steps, argmax each time."""
    seq = Sequence(SequenceCache(model.cache_spec), list(ids))
    hidden = step(model, [seq], [len(ids)])
    out = []
    for _ in range(n_new):
        tok = int(model.compute_logits(hidden[-1:]).argmax(-1))
        out.append(tok)
        seq.tokens.append(tok)
        hidden = step(model, [seq], [1])
    return out


# ---- weight source over the fixture's HF checkpoint ---------------------------------------------


class DenseStored:
    """Stand-in for the artifact's StoredTensor: a dense tensor."""

    def __init__(self, t: torch.Tensor):
        self.t = t
        self.shape = tuple(t.shape)
        self.format = "f32"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.t.to(dtype)


class HfQwen35Source:
    """Logical ninfer parameter names over a Qwen3.5 HF safetensors file (test-only)."""

    def __init__(self, path: Path, text_config: dict):
        self.cfg = text_config
        self.tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(path), "pt") as f:
            raw = {k: f.get_tensor(k).float() for k in f.keys() if "visual" not in k}
        self._map(raw)

    def _map(self, raw: dict[str, torch.Tensor]) -> None:
        c = self.cfg
        t = self.tensors
        t["text/token_embedding"] = raw["model.language_model.embed_tokens.weight"]
        if "lm_head.weight" in raw:
            t["text/output_head"] = raw["lm_head.weight"]
        t["text/final_norm"] = raw["model.language_model.norm.weight"]
        for i, kind in enumerate(c["layer_types"]):
            self._layer(raw, f"model.language_model.layers.{i}.", f"text/layers/{i}", kind)
        if "mtp.fc.weight" in raw:
            t["mtp/input_projection"] = raw["mtp.fc.weight"]
            t["mtp/embedding_norm"] = raw["mtp.pre_fc_norm_embedding.weight"]
            t["mtp/hidden_norm"] = raw["mtp.pre_fc_norm_hidden.weight"]
            t["mtp/final_norm"] = raw["mtp.norm.weight"]
            self._layer(raw, "mtp.layers.0.", "mtp/layers/0", "full_attention")

    def _layer(self, raw, hf: str, ours: str, kind: str) -> None:
        c, t = self.cfg, self.tensors
        t[f"{ours}/input_norm"] = raw[hf + "input_layernorm.weight"]
        t[f"{ours}/post_attention_norm"] = raw[hf + "post_attention_layernorm.weight"]
        for part in ("gate", "up", "down"):
            t[f"{ours}/mlp/{part}"] = raw[hf + f"mlp.{part}_proj.weight"]
        if kind == "full_attention":
            a, d = hf + "self_attn.", c["head_dim"]
            qg = raw[a + "q_proj.weight"].view(c["num_attention_heads"], 2 * d, -1)
            t[f"{ours}/attention/query"] = qg[:, :d].reshape(-1, qg.shape[-1])
            t[f"{ours}/attention/gate"] = qg[:, d:].reshape(-1, qg.shape[-1])
            for name, hf_name in (("key", "k_proj"), ("value", "v_proj"), ("output", "o_proj")):
                t[f"{ours}/attention/{name}"] = raw[a + hf_name + ".weight"]
            t[f"{ours}/attention/query_norm"] = raw[a + "q_norm.weight"]
            t[f"{ours}/attention/key_norm"] = raw[a + "k_norm.weight"]
            return
        g = hf + "linear_attn."
        kw = c["linear_num_key_heads"] * c["linear_key_head_dim"]
        q, k, v = raw[g + "in_proj_qkv.weight"].split([kw, kw, raw[g + "in_proj_z.weight"].shape[0]])
        t[f"{ours}/gdn/query"], t[f"{ours}/gdn/key"], t[f"{ours}/gdn/value"] = q, k, v
        t[f"{ours}/gdn/z"] = raw[g + "in_proj_z.weight"]
        t[f"{ours}/gdn/a_projection"] = raw[g + "in_proj_a.weight"]
        t[f"{ours}/gdn/b_projection"] = raw[g + "in_proj_b.weight"]
        t[f"{ours}/gdn/output"] = raw[g + "out_proj.weight"]
        t[f"{ours}/gdn/a_log"] = raw[g + "A_log"]
        t[f"{ours}/gdn/dt_bias"] = raw[g + "dt_bias"]
        t[f"{ours}/gdn/convolution"] = raw[g + "conv1d.weight"].squeeze(1)
        t[f"{ours}/gdn/norm"] = raw[g + "norm.weight"]

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> DenseStored:
        return DenseStored(self.tensors[name])

    def input_columns(self, name: str) -> torch.Tensor | None:
        return None
