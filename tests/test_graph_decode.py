"""GDN mixing on the kernels and the graph decode context, against the reference paged path (tiny model).

On CPU the kernels run through the Triton interpreter (NINFER_TRITON_ON_CPU=1); the reference is the model's
own `GatedDeltaNet._mix` and the CPU attention of `PagedBatchContext`. Tolerances: measured fp32 differences
of the two paths (see each test) with margin, never zero-cost exactness claims across kernels.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ninfer.engine import graphs as graphs_module
from ninfer.engine.graphs import DecodeGraphs, GraphDecodeContext, capture_sizes, graph_widths
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

    def __init__(self, model, kv_dtype: str = "fp32", fp16_state: bool = False, device: str = "cpu"):
        spec = model.cache_spec
        # 2 pages stay free
        self.kv = KvPool(spec, kv_dtype, 64 * (5 * MAX_LANES + 2), MAX_LANES, 320, device=device)
        self.states = GdnStatePool(spec, MAX_LANES, fp16_state, device=device)
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
    dev = pools.kv.device
    with torch.inference_mode():
        hidden = model.forward(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), ctx)
        ctx.commit_states()
        return model.compute_logits(hidden)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


# -- 1. GDN token mixing on the kernels ----------------------------------------------------------------------


def schedule_rounds():
    """Prefills crossing pages, a mixed round (decodes + a chunk), a verification-shaped span (4 tokens, the
    recurrent kernel with T positions) beside a decode and one alone (the whole batch), then decode rounds of
    three lanes."""
    p0, p1, p2 = tokens(70, 1), tokens(5, 2), tokens(130, 3)
    rounds = [
        [(0, p0, 0)],
        [(1, p1, 0), (2, p2[:66], 0)],
        [(0, tokens(1, 4), 70), (2, p2[66:], 66), (1, tokens(1, 5), 5)],
        [(1, tokens(4, 6), 6), (0, tokens(1, 7), 71)],
        [(1, tokens(3, 8), 10)],
    ]
    lens = {0: 72, 1: 13, 2: 130}
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
    # 1.3e-4 / 3.3e-4: a near-tie fp32 value rounds to the neighbouring fp16, one fp16 ulp is 2^-10; the conv
    # slots hold later layers' inputs, which carry the earlier layers' output differences (2.9e-5 with fp16)
    tol_logits, tol_state = (5e-4, 2 ** -10) if fp16_state else (1e-5, 1e-5)
    assert worst < tol_logits, worst
    for layer in range(len(mine.states.recurrent)):
        assert rel(mine.states.recurrent[layer], ref_pools.states.recurrent[layer]) < tol_state
        assert rel(mine.states.conv[layer], ref_pools.states.conv[layer]) < tol_logits


def test_gdn_hook_only_where_asked(model):
    pools = Pools(model)
    span = [SequenceSpan(0, 1, 0, 0)]
    assert getattr(PagedBatchContext(span, pools.kv, pools.states), "gdn_mix", None) is None  # CPU default
    assert PagedBatchContext(span, pools.kv, pools.states, gdn_kernels=True).gdn_mix is not None


# -- 2. the graph decode context (eager on CPU) vs PagedBatchContext -----------------------------------------


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]


def test_prepare_builds_every_size_once_and_rounds_reuse_them(tiny):
    """What the engine calls at start: a one-token graph for every batch size (here eager: no capture on the
    CPU); a round of 3 lanes then takes the 4-row graph, nothing new is built, and prepare again adds none."""
    kv = KvPool(tiny.cache_spec, "fp32", 8 * 64, MAX_LANES, 256)
    states = GdnStatePool(tiny.cache_spec, MAX_LANES)
    graphs = DecodeGraphs(tiny, kv, states, capture=False)
    graphs.prepare()
    built = dict(graphs._graphs)
    assert sorted(built) == [(1, 1, 4), (2, 1, 4), (4, 1, 4), (8, 1, 4)]  # (batch, positions, width)
    for lane in range(3):
        kv.assign(lane, kv.reserve(1))
    logits = graphs.run([0, 1, 2], tokens(3, 7), [0, 0, 0])
    assert logits.shape[0] == 3 and graphs._graphs == built
    graphs.prepare()
    assert all(graphs._graphs[k] is built[k] for k in built)
    with pytest.raises(ValueError, match="argmax over None columns"):
        graphs.prepare(100)  # the built graphs' argmax bound cannot change


def test_greedy_ids_come_from_the_graph(tiny, monkeypatch):
    """A graphed round's greedy tokens are the graph's own argmax below the sample vocab (the engine's
    `greedy_ids`), every row's at a verification shape; other logits or bounds get a fresh argmax."""
    from ninfer.engine.runner import ModelRunner
    from ninfer.engine.scheduler import Round, WorkItem

    kv = KvPool(tiny.cache_spec, "fp32", 8 * 64, MAX_LANES, 256)
    states = GdnStatePool(tiny.cache_spec, MAX_LANES)
    runner = ModelRunner(tiny, kv, states, decode_graphs=True)
    vocab = tiny.vocab_size - 37
    runner.graphs.prepare(vocab)
    for lane in range(3):
        kv.assign(lane, kv.reserve(1))
    for T in (1, 3):
        items = [WorkItem(None, lane, tuple(tokens(T, 9 + lane)), 4 * T, True) for lane in range(3)]
        logits = runner.run(Round(items, [], []), all_rows=T > 1)
        ids = runner.greedy_ids(logits, vocab)
        assert torch.equal(ids, logits[:, :vocab].argmax(-1)) and ids.shape == (3 * T,)
        assert ids is runner.graphs.ids  # the graph's tensor, no new argmax
        assert torch.equal(runner.greedy_ids(logits, None), logits.argmax(-1))
        assert torch.equal(runner.greedy_ids(logits.clone(), vocab), ids)
    monkeypatch.setenv("NINFER_GRAPH_ARGMAX", "0")  # the A/B's other side: the argmax after the graph
    logits = runner.run(Round(items[:1], [], []), all_rows=True)
    assert runner.graphs.ids is None and torch.equal(runner.greedy_ids(logits, vocab),
                                                     logits[:, :vocab].argmax(-1))


def prefill_lanes(model, pools: Pools, lengths: dict[int, int]) -> dict[int, int]:
    for lane, n in lengths.items():
        run_forward(model, pools, [(lane, tokens(n, 100 + lane), 0)])
    return dict(lengths)


def snapshot(pools: Pools) -> list[torch.Tensor]:
    return [t.clone() for t in pools.kv.storage + pools.states.conv + pools.states.recurrent]


def check_untouched(before: list[torch.Tensor], pools: Pools, lanes_in_round: list[int]) -> None:
    """Pages of lanes outside the round, free pages and those lanes' GDN slots are bit-identical."""
    kv, st = pools.kv, pools.states
    moved_pages = {p for lane in lanes_in_round for p in kv._lane_pages[lane]} | {kv.scratch_page}
    still = [p for p in range(kv.num_pages + 1) if p not in moved_pages]
    moved_slots = set(lanes_in_round) | {st.scratch_slot}
    slots = [s for s in range(st.slots + 1) if s not in moved_slots]
    n_kv = len(kv.storage)
    for i, (old, new) in enumerate(zip(before, snapshot(pools), strict=True)):
        keep = still if i < n_kv else slots
        assert torch.equal(old[keep], new[keep]), f"tensor {i} changed outside the round's lanes"


def compare_rounds(model, lengths: dict[int, int], rounds: list[list[int]], tol: float, kv_dtype="fp32"):
    """Decode `rounds` (lists of lanes) through DecodeGraphs (eager) and PagedBatchContext."""
    ref = Pools(model, kv_dtype)
    pos = prefill_lanes(model, ref, lengths)
    mine = ref.clone()
    graphs = DecodeGraphs(model, mine.kv, mine.states, capture=False)
    worst = 0.0
    for r, lanes in enumerate(rounds):
        toks = [tokens(1, 1000 + 10 * r + lane)[0] for lane in lanes]
        want = run_forward(model, ref, [(lane, [t], pos[lane]) for lane, t in zip(lanes, toks, strict=True)])
        before = snapshot(mine)
        got = graphs.run(lanes, toks, [pos[lane] for lane in lanes])
        check_untouched(before, mine, lanes)
        assert got.shape == want.shape
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        worst = max(worst, rel(got, want))
        for lane in lanes:
            pos[lane] += 1
    assert worst < tol, worst
    for lane in {lane for lanes in rounds for lane in lanes}:  # the real lanes' state ends up the same
        for layer in range(len(mine.states.recurrent)):
            assert rel(mine.states.recurrent[layer][lane], ref.states.recurrent[layer][lane]) < tol
    return graphs


def test_graph_context_equals_paged_context_tiny(tiny):
    # lanes at 63 / 64 / 127 / 5 / 130 tokens: the first decode writes the last row of a page or the first of
    # the next; rounds of 1, 3 and 5 lanes (padded to 1, 4, 8 with the scratch lane), lane 5 never decodes
    lengths = {0: 63, 1: 64, 2: 127, 3: 5, 4: 130, 5: 40}
    rounds = [[2], [0, 1, 2], [4, 3, 0, 2, 1], [1, 0, 3], [0]]
    # measured 1.6e-6: SDPA vs the per-lane reference attention, the GDN ops in another order
    graphs = compare_rounds(tiny, lengths, rounds, tol=1e-5)
    assert sorted(graphs._graphs) == [(1, 1, 5), (4, 1, 5), (8, 1, 5)]


def test_graph_widths(monkeypatch):
    monkeypatch.setattr(graphs_module, "GRAPH_WIDTHS", (16, 64))
    assert graph_widths(260) == [16, 64, 260] and graph_widths(64) == [16, 64] and graph_widths(10) == [10]
    monkeypatch.setenv("NINFER_GRAPH_WIDTHS", "2,300")
    assert graph_widths(260) == [2, 260]
    monkeypatch.setenv("NINFER_GRAPH_WIDTHS", "")
    assert graph_widths(260) == [260]


def test_rounds_take_the_narrowest_page_table_width(tiny, monkeypatch):
    """With graphs of 2-page tables beside the pool's 5: a round whose items all end within 128 tokens
    replays the narrow graph (the attention's view of the tables stops there), any other the full one; the
    logits equal PagedBatchContext's either way."""
    monkeypatch.setenv("NINFER_GRAPH_WIDTHS", "2")
    lengths = {0: 63, 1: 64, 2: 127, 3: 5, 4: 130, 5: 40}
    rounds = [[2], [0, 1, 2], [4, 3, 0, 2, 1], [1, 0, 3], [0]]  # the last rows at 128, 129, 131, 67, 67
    graphs = compare_rounds(tiny, lengths, rounds, tol=1e-5)
    assert sorted(graphs._graphs) == [(1, 1, 2), (4, 1, 2), (4, 1, 5), (8, 1, 5)]
    assert graphs._graphs[1, 1, 2].ctx.page_tables.shape[1] == 2
    assert graphs._graphs[4, 1, 5].ctx.page_tables.shape == graphs.kv.page_tables.shape


@pytest.mark.parametrize("kv_dtype", ["fp32", "rk8v4"])
def test_graph_context_kernels_equal_paged_context(model, triton_on_cpu, kv_dtype):
    """The kernels themselves (interpreter): paged_decode_attention and gdn_decode with device slot ids."""
    lengths = {0: 63, 1: 64, 2: 5}
    # measured 1.6e-6 for both (rk8v4: both sides decode the same stored bytes)
    compare_rounds(model, lengths, [[1, 0, 2], [0, 2]], tol=1e-5, kv_dtype=kv_dtype)


def test_graph_context_kernels_at_a_narrow_width(model, triton_on_cpu, monkeypatch):
    """The attention kernel over a one-page view of the tables (one split) where lane 2's round fits it, over
    the whole (three splits) otherwise."""
    monkeypatch.setenv("NINFER_GRAPH_WIDTHS", "1")
    graphs = compare_rounds(model, {0: 63, 1: 64, 2: 5}, [[1, 0, 2], [2], [0, 2]], tol=1e-5)
    assert sorted(graphs._graphs) == [(1, 1, 1), (2, 1, 5), (4, 1, 5)]


def compare_spans(model, lengths: dict[int, int], rounds: list[list[int]], T: int, tol: float,
                  kv_dtype="fp32"):
    """Verification-shaped rounds (every lane of a round feeds T tokens, logits of every row) through
    DecodeGraphs.run_spans (eager) and PagedBatchContext."""
    ref = Pools(model, kv_dtype)
    pos = prefill_lanes(model, ref, lengths)
    mine = ref.clone()
    graphs = DecodeGraphs(model, mine.kv, mine.states, capture=False)
    worst = 0.0
    for r, lanes in enumerate(rounds):
        toks = [tokens(T, 2000 + 10 * r + lane) for lane in lanes]
        want = run_forward(model, ref, [(lane, t, pos[lane]) for lane, t in zip(lanes, toks, strict=True)])
        before = snapshot(mine)
        got = graphs.run_spans(lanes, toks, [pos[lane] for lane in lanes])
        check_untouched(before, mine, lanes)
        assert got.shape == want.shape and got.shape[0] == len(lanes) * T
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        worst = max(worst, rel(got, want))
        for lane in lanes:
            pos[lane] += T
    assert worst < tol, worst
    for lane in {lane for lanes in rounds for lane in lanes}:
        for layer in range(len(mine.states.recurrent)):
            assert rel(mine.states.recurrent[layer][lane], ref.states.recurrent[layer][lane]) < tol
            assert rel(mine.states.conv[layer][lane], ref.states.conv[layer][lane]) < tol
    return graphs


def test_graph_context_verification_spans_tiny(tiny):
    # 4-token spans of 1, 3 and 2 lanes (padded to 1, 4, 2); lane 2's second span crosses into a new page
    graphs = compare_spans(tiny, {0: 30, 1: 64, 2: 61}, [[2], [0, 1, 2], [1, 2]], T=4, tol=1e-5)
    assert sorted(graphs._graphs) == [(1, 4, 5), (2, 4, 5), (4, 4, 5)]


def test_graph_context_verification_spans_kernels(model, triton_on_cpu):
    """The kernels (interpreter): paged decode attention with one row per position, gdn_decode with T = 3.
    fp32 rounding only: < 1e-5 on the earlier CI machines, 1.29e-5 on a Sapphire Rapids CPU (its oneDNN
    kernels sum in another order)."""
    compare_spans(model, {0: 62, 1: 5}, [[0, 1], [1]], T=3, tol=3e-5, kv_dtype="rk8v4")


class NoHostSync(TorchDispatchMode):
    """Fails on the ops that read a tensor on the host or build one from Python data (.item(), int(t),
    bool(t), torch.tensor(list), nonzero...): none may run inside a captured CUDA graph."""

    FORBIDDEN = {"_local_scalar_dense", "lift_fresh", "nonzero", "masked_select", "is_nonzero", "unique",
                 "_unique2"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        assert name not in self.FORBIDDEN, f"host sync / host data inside the graph region: aten.{name}"
        return func(*args, **(kwargs or {}))


def test_graph_region_has_no_host_sync(model, triton_on_cpu):
    pools = Pools(model, "rk8v4")
    prefill_lanes(model, pools, {0: 63, 1: 5, 2: 64})
    graphs = DecodeGraphs(model, pools.kv, pools.states, capture=False)
    ctx = GraphDecodeContext(torch.zeros(5, 4, dtype=torch.long), pools.kv, pools.states)
    graphs._stage(ctx.inputs, [[1, 2, 3], [63, 5, 64], [0, 1, 2], [64, 6, 65], [0, 1, 2]])
    graphs._forward(ctx)  # the warm-up before capture (fills the kernels' cached device tables)
    with NoHostSync():
        logits, ids = graphs._forward(ctx)
    assert logits.shape == (4, VOCAB) and torch.isfinite(logits).all()
    assert torch.equal(ids, logits.argmax(-1))


@pytest.mark.gpu
@pytest.mark.parametrize(("kv_dtype", "widths", "side"),
                         [("bf16", "", "0"), ("rk8v4", "", "0"), ("bf16", "1", "0"), ("bf16", "", "8")])
def test_cuda_graph_replay_equals_eager(kv_dtype, widths, side, monkeypatch):
    """Captured and replayed on CUDA vs the same context run eagerly, over rounds of 1, 3, 5 and 2 lanes;
    with `widths` "1" the graphs see one page of the tables (one attention split), the eager rounds five;
    with `side` "8" every graph writes the GDN states on a side stream (`gdn_decode.state_side`)."""
    model = synthetic_model("tiny", device="cuda").eval()
    pools = {}
    for mode in ("eager", "graph"):
        monkeypatch.setenv("NINFER_GRAPH_WIDTHS", widths if mode == "graph" else "")
        monkeypatch.setenv("NINFER_GDN_STATE_SIDE", side if mode == "graph" else "0")
        torch.manual_seed(0)
        kv = KvPool(model.cache_spec, kv_dtype, 64 * 40, MAX_LANES, 320, device="cuda")
        states = GdnStatePool(model.cache_spec, MAX_LANES, device="cuda")
        for lane in range(MAX_LANES):
            kv.assign(lane, kv.reserve(5))
        pools[mode] = (kv, states, DecodeGraphs(model, kv, states, capture=mode == "graph"))
    pos = dict.fromkeys(range(MAX_LANES), 0)
    for r, lanes in enumerate([[0], [0, 1, 2], [4, 3, 0, 2, 1], [5, 3], [0, 1, 2, 3, 4, 5]] * 3):
        toks = [tokens(1, 50 * r + lane)[0] for lane in lanes]
        at = [pos[lane] for lane in lanes]
        want = pools["eager"][2].run(lanes, toks, at)
        got = pools["graph"][2].run(lanes, toks, at)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert torch.equal(pools["graph"][2].ids, got.argmax(-1))  # the graph's own argmax
        assert rel(got, want) < 1e-5  # the same kernels on the same inputs: equal up to atomics' order
        for lane in lanes:
            pos[lane] += 1
    real = slice(0, pools["eager"][1].scratch_slot)  # (the scratch slot takes the captures and padding rows)
    for eager, graphed in zip(pools["eager"][1].recurrent, pools["graph"][1].recurrent, strict=True):
        assert rel(graphed[real], eager[real]) < 1e-5  # the states the rounds left (side stream joined)
    graphs = pools["graph"][2]
    width = 1 if widths else 5  # every round ends within the first page
    assert sorted(graphs._graphs) == [(1, 1, width), (2, 1, width), (4, 1, width), (8, 1, width)]
    assert all(r.seconds > 0 and r.pool_bytes >= 0 for r in graphs.records)
    # captured again after a clear while the last round's outputs (`got`) live on (step_profile's sweeps)
    graphs.clear()
    want = pools["eager"][2].run([0, 1], [7, 8], [pos[0], pos[1]])
    again = graphs.run([0, 1], [7, 8], [pos[0], pos[1]])
    assert graphs._graphs[2, 1, width].graph is not None and graphs.capture and len(graphs.records) == 1
    assert torch.equal(again.argmax(-1), want.argmax(-1)) and rel(again, want) < 1e-5 and got.shape[0] == 6


def test_engine_decode_rounds_through_graphs_same_tokens(tiny):
    """The runner sends all-decode rounds to DecodeGraphs (eager here): same greedy tokens as without,
    with lanes admitted and released between rounds — also with the decode lookahead feeding the graphs'
    token ids from the device."""
    from test_engine_invariants import drive

    from ninfer.engine.api import GenerationRequest, SamplingParams
    from ninfer.engine.engine import Engine, EngineConfig

    outs, used = [], []
    for graphs, lookahead in ((False, False), (True, False), (True, True)):
        config = EngineConfig(max_concurrency=3, max_context=256, kv_capacity=1024, kv_dtype="fp32",
                              prefill_chunk=48, decode_lookahead=lookahead)
        engine = Engine.from_model(tiny, config)
        if graphs:
            engine.runner.graphs = DecodeGraphs(tiny, engine.kv, engine.states, capture=False)
        handles = [engine.submit(GenerationRequest(f"r{i}", tuple(tokens(n, 300 + i)),
                                                   SamplingParams(max_tokens=m, temperature=0)))
                   for i, (n, m) in enumerate([(60, 12), (7, 20), (100, 6), (30, 10)])]
        outs.append(drive(engine, handles))
        used.append(engine.runner.graphs)
    assert outs[0] == outs[1] == outs[2]
    assert used[0] is None and sorted(used[1]._graphs) and sorted(used[2]._graphs)  # through the graphs


def cuda_engine_with(lookahead: bool, requests: list[tuple[int, int]]):
    """The tiny synthetic model's engine on CUDA (3 lanes, bf16 KV, captured graphs) with greedy requests of
    (prompt tokens, max_tokens) submitted; (engine, handles)."""
    from ninfer.engine.api import GenerationRequest, SamplingParams
    from ninfer.engine.engine import Engine, EngineConfig

    config = EngineConfig(max_concurrency=3, max_context=256, kv_capacity=1024, kv_dtype="bf16",
                          prefill_chunk=48, device="cuda", decode_lookahead=lookahead)
    engine = Engine.from_model(synthetic_model("tiny", device="cuda").eval(), config)
    handles = [engine.submit(GenerationRequest(f"r{i}", tuple(tokens(n, 300 + i)),
                                               SamplingParams(max_tokens=m, temperature=0)))
               for i, (n, m) in enumerate(requests)]
    return engine, handles


@pytest.mark.gpu
def test_decode_lookahead_on_cuda_graphs_same_tokens():
    """On CUDA (captured graphs, the next round's token ids copied on the device, the tokens' way to the
    host through pinned memory): greedy tokens equal to the engine without the lookahead."""
    from test_engine_invariants import drive

    outs = [drive(*cuda_engine_with(lookahead, [(60, 12), (7, 20), (100, 6), (30, 10)]))
            for lookahead in (False, True)]
    assert outs[0] == outs[1]


@pytest.mark.gpu
def test_decode_rounds_with_lanes_ending_do_not_synchronise():
    """On CUDA with the lookahead, once every lane decodes: the rounds — lanes ending among them, the
    lookahead gathering the others' tokens — make no synchronising call (`torch.cuda.set_sync_debug_mode`
    "error"), and give the tokens of the engine without the lookahead."""
    from test_engine_invariants import drive

    outs = []
    for lookahead in (False, True):
        engine, handles = cuda_engine_with(lookahead, [(20, 14), (9, 6), (30, 10)])
        while any(h.seq.generated < 1 for h in handles):  # the prefills (eager rounds: they synchronise)
            engine.step(engine.scheduler.schedule())
        torch.cuda.set_sync_debug_mode("error" if lookahead else 0)
        try:
            outs.append(drive(engine, handles))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert outs[0] == outs[1]
    assert sorted(len(t) for t, _ in outs[1].values()) == [6, 10, 14]


def test_no_cuda_graphs_flag_reaches_engine_config():
    from ninfer.cli.serve import build_parser, engine_config

    assert engine_config(build_parser().parse_args(["m.ninfer", "--no-cuda-graphs"])).cuda_graphs is False
    assert engine_config(build_parser().parse_args(["m.ninfer"])).cuda_graphs is True
    default = engine_config(build_parser().parse_args(["m.ninfer"]))
    assert default.decode_lookahead is None  # on CUDA yes, on CPU no
    assert replace(default, device="cuda").looks_ahead and not replace(default, device="cpu").looks_ahead
    assert engine_config(build_parser().parse_args(["m.ninfer", "--decode-lookahead"])).looks_ahead
    off = engine_config(build_parser().parse_args(["m.ninfer", "--no-decode-lookahead", "--device", "cuda"]))
    assert not off.looks_ahead


@pytest.mark.gpu
def test_gdn_kernels_on_cuda_equal_reference_mixing():
    """fla-core chunked prefill + the decode kernel vs the reference mixing, both on CUDA (fp32 model)."""
    model = synthetic_model("tiny", device="cuda").eval()
    ref_pools = Pools(model, device="cuda")
    mine = ref_pools.clone()
    for batch in schedule_rounds():
        want = run_forward(model, ref_pools, batch, gdn_kernels=False)
        got = run_forward(model, mine, batch, gdn_kernels=True)
        assert rel(got, want) < 5e-3  # fla's intra-chunk tf32/bf16 dots: 1.5e-3 measured on its outputs


@pytest.mark.gpu
def test_engine_greedy_same_with_and_without_cuda_graphs():
    from test_engine_invariants import drive

    from ninfer.engine.api import GenerationRequest, SamplingParams
    from ninfer.engine.engine import Engine, EngineConfig

    model = synthetic_model("tiny", device="cuda").eval()
    outs = []
    for graphs in (False, True):
        config = EngineConfig(max_concurrency=3, max_context=256, kv_capacity=1024, kv_dtype="bf16",
                              device="cuda", cuda_graphs=graphs)
        engine = Engine.from_model(model, config)
        handles = [engine.submit(GenerationRequest(f"r{i}", tuple(tokens(n, 300 + i)),
                                                   SamplingParams(max_tokens=m, temperature=0)))
                   for i, (n, m) in enumerate([(60, 12), (7, 20), (100, 6), (30, 10)])]
        outs.append(drive(engine, handles))
        assert (engine.runner.graphs is not None) == graphs
    assert outs[0] == outs[1]


def conv_modes(tmp_path, monkeypatch, gguf_name: str, layout: str, modes: dict, rounds: list,
               eager: tuple[str, ...] = ()) -> dict:
    """The fixture model with its matrices on the il32 / q4il layout, `rounds` ((lanes, positions a lane)
    each) captured (or run eagerly through the graphs' context: the modes named in `eager`) under each of
    `modes` (name: environment settings): per mode the rounds' logits, the state pools after, and the set of
    (lanes, positions) of the convs the il32 / q4il GEMVs ran (0: none)."""
    from conftest import convert_tiny

    from ninfer.artifact import open_artifact
    from ninfer.kernels import gemv_il, gemv_q4il

    monkeypatch.setenv("NINFER_IQ3S_IL", "1" if layout == "NINFER_IQ3S_IL" else "0")
    monkeypatch.setenv("NINFER_Q4K_IL", "1" if layout == "NINFER_Q4K_IL" else "0")
    art = open_artifact(convert_tiny(tmp_path / "tiny.ninfer", gguf_name))
    model = load_model(art, dtype=torch.bfloat16, device="cuda", load_mtp=False, quantized_weights=True)
    shapes = []  # every GEMV launch's conv as the il32 / q4il wrappers hand it over
    arguments = gemv_il.conv_arguments
    for module in (gemv_il, gemv_q4il):
        monkeypatch.setattr(module, "conv_arguments", lambda conv: (shapes.append(
            0 if conv is None else (conv.slot_ids.shape[0], conv.positions)), arguments(conv))[1])
    runs = {}
    for mode, env in modes.items():
        for name in ("NINFER_LANE_CONV", "NINFER_LANE_CONV_COLUMNS", "NINFER_LANE_CONV_SPANS"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env:
            monkeypatch.setenv(name, value)
        kv = KvPool(model.cache_spec, "bf16", 64 * 40, MAX_LANES, 320, device="cuda")
        states = GdnStatePool(model.cache_spec, MAX_LANES, device="cuda")
        for lane in range(MAX_LANES):
            kv.assign(lane, kv.reserve(5))
        graphs = DecodeGraphs(model, kv, states, capture=mode not in eager)
        shapes.clear()
        pos, logits = dict.fromkeys(range(MAX_LANES), 0), []
        for r, (lanes, T) in enumerate(rounds):
            toks = [tokens(T, 70 * r + lane) for lane in lanes]
            logits.append(graphs.run_spans(lanes, toks, [pos[lane] for lane in lanes]).clone())
            for lane in lanes:
                pos[lane] += T
        assert mode in eager or all(entry.graph is not None for entry in graphs._graphs.values())  # captured
        runs[mode] = logits, states, set(shapes)
    return runs


def assert_modes_agree(runs: dict, mine: str, ref: str, label: str) -> None:
    """Two `conv_modes` runs' logits, conv and recurrent states (the real lanes') within 1e-5: the same fp32
    arithmetic on the same bf16 inputs — on the H200 the logits and conv states came out identical and the
    recurrent states within 2.1e-7 (gpu-notes "Session 50"), so the bound leaves a last bit's worth of FMA
    contraction its room, and a wiring slip (a lane on another's slot) moves them by O(1)."""

    def worst_of(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
        return max(rel(a[:MAX_LANES], b[:MAX_LANES]) for a, b in zip(got, want, strict=True))

    a, b = runs[mine][1], runs[ref][1]
    worst = {"logits": max(rel(x, y) for x, y in zip(runs[mine][0], runs[ref][0], strict=True)),
             "conv": worst_of(a.conv, b.conv), "recurrent": worst_of(a.recurrent, b.recurrent)}
    print(f"{label}: worst relative error, {mine} against {ref}: {worst}")
    assert max(worst.values()) < 1e-5


LAYOUTS = [("model-iq3_s.gguf", "NINFER_IQ3S_IL"), ("model-q4_k_m.gguf", "NINFER_Q4K_IL")]


@pytest.mark.gpu
@pytest.mark.parametrize(("gguf_name", "layout"), LAYOUTS)
def test_captured_rounds_with_the_conv_in_every_lanes_projection(tmp_path, monkeypatch, gguf_name, layout):
    """Captured rounds of 1-6 lanes (graphs of 1, 2, 4 and 8 rows): with NINFER_LANE_CONV_COLUMNS=8 the GDN
    input projection runs every lane's decode conv in its epilogue, with NINFER_LANE_CONV=0 the conv kernel
    does; the logits agree and so do the lanes' conv and recurrent states after."""
    lanes = [[0], [0, 1, 2], [4, 5], [3, 0, 2, 1], [5, 4, 3, 2, 1, 0]] * 2
    modes = {"epilogue": [("NINFER_LANE_CONV_COLUMNS", "8")], "kernel": [("NINFER_LANE_CONV", "0")]}
    runs = conv_modes(tmp_path, monkeypatch, gguf_name, layout, modes, [(each, 1) for each in lanes])
    assert {(n, 1) for n in (1, 2, 4, 8)} <= runs["epilogue"][2] and runs["kernel"][2] <= {0}
    assert_modes_agree(runs, "epilogue", "kernel", gguf_name)


@pytest.mark.gpu
@pytest.mark.parametrize(("gguf_name", "layout"), LAYOUTS)
def test_verification_rounds_run_each_lanes_conv_in_the_projection(tmp_path, monkeypatch, gguf_name, layout):
    """Verification rounds (one lane of 4 and of 2 positions, two lanes of 4: 4 and 8 columns; a decode
    round between; three lanes of 3 positions, 12 columns, past the GEMVs' 8), run eagerly through the decode
    graphs' context: every il32 / q4il GEMV handed a span's conv runs it (NINFER_LANE_CONV_SPANS=1), each
    lane's conv outputs and slot as `conv_epilogue_store`'s arithmetic on that call's own outputs, position
    after position; then the same rounds captured: logits and states as the eager rounds' (the same kernels).
    Against the conv kernel's path no bound of a last bit holds over rounds: its SiLU (Triton's) and the
    epilogue's (CUDA's expf and division) round apart in a last bit now and then, and over rounds such a bit
    can move an int8 activation's rounding (session 73, H100, the IQ3_S fixture: four rounds' logits
    identical, the fifth's 2 % apart, eager and captured alike)."""
    from dataclasses import replace as replaced

    from conftest import assert_conv_ran

    from ninfer.models.weights import lane_layouts

    checked = []

    def checking(matmul):
        def run(words, x, n, conv=None):
            if conv is None or torch.cuda.is_current_stream_capturing():  # (no host reads in a capture)
                return matmul(words, x, n, conv=conv)
            before = conv.slots.clone()
            y = matmul(words, x, n, conv=conv)
            ids = conv.slot_ids.tolist()
            # (a capture's warm-up runs every lane on the scratch slot: one slot, several lanes, no order)
            if conv.applied and conv.positions > 1 and len(set(ids)) == len(ids):
                assert_conv_ran(y, conv, before, atol=1e-5)
                checked.append((conv.slot_ids.shape[0], conv.positions))
            return y
        return run

    layouts = lane_layouts()
    for name in ("il32", "q4il"):
        monkeypatch.setitem(layouts, name, replaced(layouts[name], matmul=checking(layouts[name].matmul)))
    rounds = [([0], 4), ([1, 2], 4), ([3], 2), ([0, 1, 2], 1), ([2, 0], 4), ([4, 5, 3], 3), ([0], 4)]
    every = [("NINFER_LANE_CONV_SPANS", "1")]  # the tensor-core il32 kernel's too (not by default)
    runs = conv_modes(tmp_path, monkeypatch, gguf_name, layout, {"eager": every, "graphs": every}, rounds,
                      eager=("eager",))
    assert {(1, 4), (2, 4), (1, 2)} <= set(checked) and {(1, 4), (2, 4), (1, 2)} <= runs["graphs"][2]
    assert all(shape == 0 or shape[0] * shape[1] <= 8 for shape in runs["graphs"][2])
    assert_modes_agree(runs, "graphs", "eager", gguf_name)
