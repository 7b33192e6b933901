"""The workspace measured at start (engine.workspace) and what the memory plan and ledger make of it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_engine_fake_model import FakeHybridModel

from ninfer.engine.engine import Engine, EngineConfig
from ninfer.engine.graphs import graph_widths
from ninfer.engine.kv_pool import KvPool, pages_for
from ninfer.engine.memory import GIB, MIB, MemoryLedger, plan_kv_capacity
from ninfer.engine.workspace import measure_workspace
from ninfer.errors import EngineConfigError


class ScriptedMeter:
    """Growths handed out in order, one a round, and the graphs' pool; records the decode graphs it was
    handed (built as the engine builds them at start: eagerly on the CPU)."""

    def __init__(self, growths: list[int], other: int, slack: int = 0, graphs: int = 0):
        self.growths, self.other_bytes, self.slack_bytes, self.begun = list(growths), other, slack, 0
        self.graph_bytes, self.built = graphs, []

    def begin(self) -> None:
        self.begun += 1

    def grown(self) -> int:
        return self.growths.pop(0)

    def graphs(self, graphs) -> int:
        graphs.prepare()
        self.built = sorted(graphs._graphs)
        return self.graph_bytes

    def other(self) -> int:
        return self.other_bytes

    def slack(self) -> int:
        return self.slack_bytes


class RowCounter(FakeHybridModel):
    def __init__(self):
        super().__init__()
        self.rounds: list[tuple[int, list[int]]] = []

    def forward(self, input_ids, positions, ctx):
        self.rounds.append((len(input_ids), positions.tolist()))
        return super().forward(input_ids, positions, ctx)


@pytest.mark.parametrize(("graphs", "max_context"), [(True, 600), (True, 4096), (False, 600)])
def test_measure_runs_the_widest_round_then_captures_the_engines_graphs(graphs, max_context):
    from ninfer.kernels import gguf_matmul

    model = RowCounter()
    meter = ScriptedMeter([7 * MIB], other=5 * MIB, slack=2 * MIB, graphs=48 * MIB)
    gguf_matmul.dense_piece(torch.device("cpu"), torch.float32, 4, 8)  # an earlier engine's
    ws = measure_workspace(model, model.cache_spec, kv_dtype="bf16", gdn_state_fp16=False, lanes=3,
                           prefill_chunk=130, max_context=max_context, graphs=graphs,
                           device=torch.device("cpu"), meter=meter)
    widest = model.rounds[0]
    assert widest[0] == 130 + 2 and widest[1] == list(range(130)) + [0, 0]  # the chunk beside 2 decode rows
    assert (ws.activations, ws.other, ws.slack) == (7 * MIB, 5 * MIB, 2 * MIB)
    if graphs:
        # the one-token graph of every batch size at every page-table width the engine's own table gives
        # (600 tokens: its 10 pages alone; 4096: narrower ones too), their pool as the meter measured it
        widths = graph_widths(pages_for(max_context))
        assert widths[-1] == pages_for(max_context) and (len(widths) > 1 or max_context == 600)
        assert meter.built == sorted((n, 1, w) for n in (1, 2, 4) for w in widths)
        assert ws.graphs == 48 * MIB
    else:
        assert meter.built == [] and ws.graphs == 0
    assert len(model.rounds) == 1 and meter.begun == 1
    assert ws.total == ws.activations + ws.graphs + ws.other + ws.slack
    assert not gguf_matmul._DENSE_PIECES  # let go before the widest round, which makes its own (measured)


def test_a_widest_round_out_of_memory_names_the_flags():
    class Starved(FakeHybridModel):
        def forward(self, input_ids, positions, ctx):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 356.00 MiB")

    model = Starved()
    with pytest.raises(EngineConfigError, match=r"1024-token prefill chunk beside 7 decode rows .*356\.00 MiB"
                       r".*--prefill-chunk or --max-concurrency"):
        measure_workspace(model, model.cache_spec, kv_dtype="bf16", gdn_state_fp16=False, lanes=8,
                          prefill_chunk=1024, max_context=4096, graphs=True, device=torch.device("cpu"),
                          meter=ScriptedMeter([], 0))


def test_auto_capacity_leaves_the_workspace():
    spec = FakeHybridModel().cache_spec
    per_token = KvPool.bytes_per_token(spec, "bf16")
    kwargs = dict(spec=spec, kv_dtype="bf16", device="cuda", budget_bytes=GIB, weights_bytes=100 * MIB,
                  gdn_bytes=MIB, headroom_mib=64, max_context=256, max_concurrency=1)
    lean = plan_kv_capacity("auto", workspace_bytes=0, **kwargs)
    wide = plan_kv_capacity("auto", workspace_bytes=300 * MIB, **kwargs)
    assert lean == (GIB - 165 * MIB) // per_token // 64 * 64
    assert lean - wide == pytest.approx(300 * MIB / per_token, abs=64)
    with pytest.raises(EngineConfigError, match="MiB of workspace"):
        plan_kv_capacity("auto", workspace_bytes=GIB, **kwargs)


def test_ledger_counts_graphs_planned_or_captured_other_and_slack():
    led = MemoryLedger("cuda:0", 10 * GIB, 4 * GIB, 1024, "bf16", GIB, 2, 64 * MIB, 512 * MIB,
                       graphs_planned_bytes=200 * MIB, other_bytes=500 * MIB, slack_bytes=30 * MIB)
    assert led.free_bytes == 10 * GIB - 5 * GIB - 1306 * MIB
    assert led.held_bytes == 5 * GIB + 806 * MIB  # slack held by this process's allocator, other not
    grown = replace(led, graphs_bytes=260 * MIB)
    assert grown.free_bytes == led.free_bytes - 60 * MIB  # captured past the plan: the larger counts
    line = led.line()
    assert "graphs 0 MiB of 200 MiB planned" in line and "other 500 MiB" in line and "slack 30 MiB" in line


def test_cpu_engine_keeps_the_stand_in():
    engine = Engine.from_model(FakeHybridModel(), EngineConfig(max_context=128, kv_capacity=128))
    led = engine.memory_ledger()
    assert (led.workspace_bytes, led.graphs_planned_bytes, led.graphs_bytes, led.other_bytes) == (
        256 * MIB, 0, 0, 0)


@pytest.mark.gpu
def test_auto_kv_leaves_room_for_the_widest_round_and_the_graphs(monkeypatch):
    """On the H200, the allocator capped at the plan's budget (less what others hold): the synthetic 9B
    (iq3_s blocks) with `--kv-capacity auto` and 16 MiB headroom runs a 1024-token chunk beside 7 decoding
    lanes, then rounds of 8, 4, 2, 1 lanes through captured graphs, without running out; the graphs' pool
    is what its plan measured, at the default two page-table widths (session 73: a modelled plan 20 MiB
    short there). What other processes hold is read once, at the start: test workers beside this
    one allocate and free meanwhile (session 54: a plan read 28 GiB of theirs as this engine's "other")."""
    from test_engine_invariants import drive

    from ninfer.engine.api import GenerationRequest, SamplingParams
    from ninfer.engine.synthetic import synthetic_model
    from ninfer.engine.workspace import CudaMeter

    model = synthetic_model("9b", torch.bfloat16, device="cuda", wtype="iq3_s", quantized_weights=True)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    others = total - free - torch.cuda.memory_reserved()
    monkeypatch.setattr(CudaMeter, "other", lambda self: others)
    limit = total - free + 1536 * MIB  # everything held now, and 1.5 GiB for KV, workspace and graphs
    config = EngineConfig(max_concurrency=8, max_context=4096, kv_capacity="auto", device="cuda",
                          gpu_memory_limit_mib=limit // MIB, kv_headroom_mib=16)
    engine = Engine.from_model(model, config)
    start = engine.memory_ledger()
    print(start.line())
    assert start.kv_tokens >= 4096 and start.workspace_bytes > 0
    # every size captured at start, into a pool that grew as the plan's captures over throwaway pools did
    assert 0 < start.graphs_bytes == start.graphs_planned_bytes
    torch.cuda.set_per_process_memory_fraction((start.budget_bytes - start.other_bytes) / total)
    try:
        # one prefill chunk a round: d0..d6 (one chunk each) decode beside the long prompt's two chunks, then
        # all eight decode, then fewer and fewer
        def request(name, ids, n):
            return engine.submit(GenerationRequest(name, ids, SamplingParams(max_tokens=n, temperature=0,
                                                                             ignore_eos=True)))

        handles = [request(f"d{i}", tuple(range(5 + i, 40 + i)), 30 - 3 * i) for i in range(7)]
        handles.append(request("long", tuple(range(100, 2148)), 16))
        out = drive(engine, handles)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert all(finish == "length" for _, finish in out.values())
    end = engine.memory_ledger()
    print(end.line(), f"peak reserved {torch.cuda.max_memory_reserved() / MIB:,.0f} MiB")
    assert 0 < end.graphs_bytes <= end.graphs_planned_bytes


def test_stranded_bytes_by_the_live_blocks_beside_them():
    """bench/memory_probe.py --stranded: a segment's inactive bytes count only beside live blocks (a wholly
    free segment can be handed back, a wholly live one strands nothing), shared by the live blocks' sizes
    and credited to their innermost frame in our code; a CUDA graph's private pool is left out."""
    from bench.memory_probe import stranded_by_site

    def block(size_mib, state, *files):
        frames = [{"filename": f, "line": 7, "name": "f"} for f in files]
        return {"size": size_mib * MIB, "state": state, "frames": frames}

    torch_frame = "/site-packages/torch/nn/functional.py"
    norm = (torch_frame, "/work/main/ninfer/kernels/fused.py", "/work/main/bench/memory_probe.py")
    pool = ("/work/main/ninfer/engine/kv_pool.py",)
    snapshot = {"segments": [
        {"blocks": [block(20, "active_allocated", *pool)]},  # all live
        {"blocks": [block(20, "inactive", *norm)]},  # all free: released on demand
        {"blocks": [block(2, "active_allocated", *norm), block(6, "active_awaiting_free", *pool),
                    block(8, "inactive", *norm)]},
        {"blocks": [block(1, "active_allocated", *norm), block(3, "inactive", *pool), block(2, "inactive")]},
        {"blocks": [block(1, "active_allocated", *norm), block(9, "inactive")], "segment_pool_id": (1, 0)},
    ]}
    rows = stranded_by_site(snapshot)
    assert [(r["site"], r["stranded"] / MIB, r["live"] / MIB, r["blocks"]) for r in rows] == [
        ("ninfer/kernels/fused.py:7 f", 7.0, 3.0, 2), ("ninfer/engine/kv_pool.py:7 f", 6.0, 6.0, 1)]
