"""A tiny random hybrid model (attention + a GDN-like recurrence) that uses the BatchContext seam, and a
contiguous-cache context to check the engine's paged context against.

Other engine tests import `FakeHybridModel` and `ContiguousContext` from here.
"""

from __future__ import annotations

import math

import torch

from ninfer.models.cache_spec import CacheSpec
from ninfer.models.context import GdnState, SequenceSpan


class FakeHybridModel(torch.nn.Module):
    """Layers: gdn, gdn, attention, gdn, attention. Hidden 64, 4 q heads / 2 kv heads of 64, vocab 97."""

    kinds = ("gdn", "gdn", "attn", "gdn", "attn")

    def __init__(self, seed: int = 0, vocab: int = 97, hidden: int = 64, head_dim: int = 64):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.hidden, self.hd, self.hq, self.hkv = hidden, head_dim, 4, 2
        self.vocab_size = vocab

        def w(*shape, s=0.3):
            return torch.nn.Parameter(torch.randn(*shape, generator=g) * s / math.sqrt(shape[-1]) * 3)

        self.embed_w = w(vocab, hidden, s=0.3)
        self.head_w = w(vocab, hidden)
        self.attn = torch.nn.ParameterList()
        self.gdn = torch.nn.ParameterList()
        for kind in self.kinds:
            if kind == "attn":
                self.attn.append(w((self.hq + 2 * self.hkv) * head_dim + self.hq * head_dim, hidden))
                self.attn.append(w(hidden, self.hq * head_dim))
            else:
                self.gdn.append(w(48, hidden))  # conv channels: q 16 | k 16 | v 16 (2 heads x 8)
                self.gdn.append(w(48, 4, s=1.0))  # conv weight [C, K]
                self.gdn.append(w(hidden, 16))
        n_gdn = self.kinds.count("gdn")
        self.cache_spec = CacheSpec(num_kv_layers=self.kinds.count("attn"), kv_heads=self.hkv,
                                    head_dim=head_dim, num_gdn_layers=n_gdn, gdn_conv_channels=48,
                                    gdn_conv_kernel=4, gdn_key_heads=2, gdn_value_heads=2, gdn_key_dim=8,
                                    gdn_value_dim=8)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        x = self.embed_w[input_ids]
        ia = ig = 0
        for kind in self.kinds:
            if kind == "attn":
                x = x + self._attention(x, positions, ia, ctx)
                ia += 1
            else:
                x = x + self._gdn(x, ig, ctx)
                ig += 1
            x = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.head_w.T).float()

    def _attention(self, x, positions, i, ctx):
        wqkv, wo = self.attn[2 * i], self.attn[2 * i + 1]
        t, d = x.shape[0], self.hd
        qkvg = x @ wqkv.T
        q = qkvg[:, : self.hq * d].reshape(t, self.hq, d)
        k = qkvg[:, self.hq * d: (self.hq + self.hkv) * d].reshape(t, self.hkv, d)
        v = qkvg[:, (self.hq + self.hkv) * d: (self.hq + 2 * self.hkv) * d].reshape(t, self.hkv, d)
        gate = qkvg[:, (self.hq + 2 * self.hkv) * d:]
        # a position-dependent rotation of half the dims (a stand-in for RoPE)
        ang = positions.float()[:, None, None] * 0.1
        q = torch.cat([q[..., :32] * torch.cos(ang) + q[..., 32:] * torch.sin(ang), q[..., 32:]], -1)
        k = torch.cat([k[..., :32] * torch.cos(ang) + k[..., 32:] * torch.sin(ang), k[..., 32:]], -1)
        o = ctx.attention(i, q, k, v).reshape(t, -1) * torch.sigmoid(gate)
        return o @ wo.T

    def _gdn(self, x, i, ctx):
        win, wconv, wout = self.gdn[3 * i], self.gdn[3 * i + 1], self.gdn[3 * i + 2]
        u = x @ win.T
        out = torch.empty(x.shape[0], 16)
        for s, span in enumerate(ctx.spans):
            rows = slice(span.start, span.start + span.length)
            state: GdnState = ctx.gdn_state(i, s)
            seq = torch.cat([state.conv.T, u[rows]], 0)  # [K-1+L, C]
            y = torch.stack([(seq[j: j + 4] * wconv.T).sum(0) for j in range(span.length)])
            y = torch.nn.functional.silu(y)
            state.conv.copy_(seq[-3:].T)
            S = state.recurrent.float().clone()
            for j in range(span.length):
                q, k, v = y[j, :16].reshape(2, 8), y[j, 16:32].reshape(2, 8), y[j, 32:].reshape(2, 8)
                k = k / (k.norm(dim=-1, keepdim=True) + 1e-6)
                S = 0.9 * S + 0.5 * torch.einsum("hk,hv->hkv", k, v - torch.einsum("hkv,hk->hv", S, k))
                out[span.start + j] = torch.einsum("hkv,hk->hv", S, q).reshape(16)
            state.recurrent.copy_(S)
        return out @ wout.T


class ContiguousContext:
    """Unpaged fp32 reference: one growing K/V list and one state per sequence id."""

    def __init__(self, spec: CacheSpec):
        self.spec = spec
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.states: dict[tuple[int, int], GdnState] = {}
        self.spans: list[SequenceSpan] = []

    def attention(self, kv_layer, q, k, v):
        from ninfer.engine.paged_context import causal_attention

        out = torch.empty_like(q)
        for span in self.spans:
            rows = slice(span.start, span.start + span.length)
            old = self.kv.get((kv_layer, span.slot), (k[:0], v[:0]))
            kk, vv = torch.cat([old[0], k[rows]]), torch.cat([old[1], v[rows]])
            self.kv[(kv_layer, span.slot)] = (kk, vv)
            kt, vt = kk.float().transpose(0, 1), vv.float().transpose(0, 1)
            out[rows] = causal_attention(q[rows].float(), kt, vt, span.cached_tokens)
        return out

    def gdn_state(self, gdn_layer, span_index):
        slot = self.spans[span_index].slot
        sp = self.spec
        key = (gdn_layer, slot)
        if key not in self.states:
            self.states[key] = GdnState(torch.zeros(sp.conv_state_shape),
                                        torch.zeros(sp.recurrent_state_shape))
        return self.states[key]


def full_forward_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits at every position from one unpaged forward."""
    ctx = ContiguousContext(model.cache_spec)
    ctx.spans = [SequenceSpan(0, len(ids), 0, 0)]
    with torch.inference_mode():
        h = model.forward(torch.tensor(ids), torch.arange(len(ids)), ctx)
        return model.compute_logits(h)


def test_fake_model_is_causal_and_deterministic():
    model = FakeHybridModel()
    ids = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    a = full_forward_logits(model, ids)
    b = full_forward_logits(model, ids[:12])
    assert torch.allclose(a[:12], b, atol=1e-5)
    assert a.std() > 0.3  # logits are not degenerate
