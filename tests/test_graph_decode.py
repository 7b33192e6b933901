"""GDN mixing on the kernels and the graph decode context, against the reference paged path (tiny model).

On CPU the kernels run through the Triton interpreter (NINFER_TRITON_ON_CPU=1); the reference is the model's
own `GatedDeltaNet._mix` and the CPU attention of `PagedBatchContext`. Tolerances: measured fp32 differences
of the two paths (see each test) with margin, never zero-cost exactness claims across kernels.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ninfer.engine.kv_pool import KvPool
from ninfer.engine.paged_context import PagedBatchContext
from ninfer.engine.state_pool import GdnStatePool
from ninfer.engine.synthetic import SyntheticSource, synthetic_config, synthetic_model
from ninfer.models import load_model
from ninfer.models.context import SequenceSpan

MAX_LANES = 6
VOCAB = 512


# The "tiny" geometry scaled down further for the Triton interpreter (its reductions run element by element in
# Python: one 128x128-state GDN decode call takes ~100 s there); same architecture, 3 GDN + 1 attention layer.
MICRO = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=VOCAB)


def micro_model():
    cfg = {**synthetic_config("tiny"), **MICRO}
    cfg["rope_parameters"] = {**cfg["rope_parameters"], "mrope_section": [3, 3, 2]}
    return load_model(SyntheticSource(cfg, seed=3), dtype=torch.float32, device="cpu", load_mtp=False).eval()


@pytest.fixture(scope="module")
def model():
    return micro_model()


@pytest.fixture(scope="module")
def tiny():
    return synthetic_model("tiny").eval()


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """This area's kernels (GDN decode, paged attention) through the interpreter; the models' fused
    elementwise kernels stay on their references (tested in test_fused_ops; too slow interpreted here)."""
    monkeypatch.setenv("NINFER_TRITON_ON_CPU", "1")
    monkeypatch.setattr("ninfer.kernels.fused.runs_on", lambda t: False)


class Pools:
    """A KV pool + GDN slots with lanes mapped to pages (enough for 300 tokens each)."""

    def __init__(self, model, kv_dtype: str = "fp32", fp16_state: bool = False):
        spec = model.cache_spec
        self.kv = KvPool(spec, kv_dtype, 64 * 5 * MAX_LANES, MAX_LANES, 320)
        self.states = GdnStatePool(spec, MAX_LANES, fp16_state)
        gen = torch.Generator().manual_seed(7)
        for lane in range(MAX_LANES):  # shuffled pages: lanes do not own contiguous ids
            pages = self.kv.reserve(5)
            self.kv.assign(lane, [pages[i] for i in torch.randperm(5, generator=gen).tolist()])

    def clone(self) -> Pools:
        return copy.deepcopy(self)


def run_forward(model, pools: Pools, batch: list[tuple[int, list[int], int]], **ctx_kw) -> torch.Tensor:
    """batch: (lane, token ids, start position) per span -> logits of every row [T, vocab]."""
    spans, ids, pos, row = [], [], [], 0
    for lane, toks, start in batch:
        spans.append(SequenceSpan(row, len(toks), start, lane))
        ids += toks
        pos += list(range(start, start + len(toks)))
        row += len(toks)
    ctx = PagedBatchContext(spans, pools.kv, pools.states, **ctx_kw)
    with torch.inference_mode():
        hidden = model.forward(torch.tensor(ids), torch.tensor(pos), ctx)
        ctx.commit_states()
        return model.compute_logits(hidden)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


# -- 1. GDN token mixing on the kernels ----------------------------------------------------------------------


def schedule_rounds():
    """Prefills crossing pages, a mixed round (decodes + a chunk), then decode rounds of three lanes."""
    p0, p1, p2 = tokens(70, 1), tokens(5, 2), tokens(130, 3)
    rounds = [
        [(0, p0, 0)],
        [(1, p1, 0), (2, p2[:66], 0)],
        [(0, tokens(1, 4), 70), (2, p2[66:], 66), (1, tokens(1, 5), 5)],
    ]
    lens = {0: 71, 1: 6, 2: 130}
    for r in range(4):
        rounds.append([(lane, tokens(1, 10 + 3 * r + lane), lens[lane] + r) for lane in (2, 0, 1)])
    return rounds


@pytest.mark.parametrize("fp16_state", [False, True])
def test_gdn_kernels_equal_reference_mixing(model, triton_on_cpu, fp16_state):
    ref_pools = Pools(model, fp16_state=fp16_state)
    mine = ref_pools.clone()
    worst = 0.0
    for batch in schedule_rounds():
        want = run_forward(model, ref_pools, batch, gdn_kernels=False)
        got = run_forward(model, mine, batch, gdn_kernels=True)
        worst = max(worst, rel(got, want))
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    # measured: fp32 state 3.2e-6 logits / 1.3e-6 state (summation order of kernel vs reference); fp16 state
    # 1.3e-4 / 3.3e-4: a near-tie fp32 value rounds to the neighbouring fp16, one fp16 ulp is 2^-10
    tol_logits, tol_state = (5e-4, 2 ** -10) if fp16_state else (1e-5, 1e-5)
    assert worst < tol_logits, worst
    for layer in range(len(mine.states.recurrent)):
        assert rel(mine.states.recurrent[layer], ref_pools.states.recurrent[layer]) < tol_state
        assert rel(mine.states.conv[layer], ref_pools.states.conv[layer]) < 1e-5


def test_gdn_hook_only_where_asked(model):
    pools = Pools(model)
    span = [SequenceSpan(0, 1, 0, 0)]
    assert getattr(PagedBatchContext(span, pools.kv, pools.states), "gdn_mix", None) is None  # CPU default
    assert PagedBatchContext(span, pools.kv, pools.states, gdn_kernels=True).gdn_mix is not None
