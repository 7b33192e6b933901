"""Decode lookahead (`EngineConfig.decode_lookahead`): a decode round launches the next one before its tokens
reach the host (greedy rounds take the next round's argmax, sampled ones sample its logits at the next step).
The tokens, finishes, page accounting and cancellation must be those of the plain engine (random hybrid
model, CPU)."""

from __future__ import annotations

import pytest
import torch
from test_engine_fake_model import FakeHybridModel
from test_engine_invariants import drive, prompt, req

from ninfer.engine.api import GenerationRequest, SamplingParams
from ninfer.engine.engine import Engine, EngineConfig, _Lookahead
from ninfer.engine.scheduler import Round, WorkItem


def make_engine(lookahead: bool, eos_ids: tuple[int, ...] = (), **kw) -> Engine:
    cfg = dict(max_concurrency=4, max_context=512, kv_capacity=2048, kv_dtype="fp32", prefill_chunk=16,
               decode_lookahead=lookahead)
    cfg.update(kw)
    return Engine.from_model(FakeHybridModel(), EngineConfig(**cfg), eos_ids=eos_ids)


def count_lookaheads(engine: Engine) -> list[int]:
    """Counts the rounds launched with their tokens on the device (the lookaheads)."""
    calls = [0]
    run = engine.runner.run

    def counted(rnd, all_rows=False, device_ids=None):
        calls[0] += device_ids is not None
        return run(rnd, all_rows, device_ids)

    engine.runner.run = counted
    return calls


def staggered(engine: Engine) -> dict:
    """Greedy and sampled requests arriving while others prefill and decode, ending at different rounds."""
    handles = [engine.submit(req("g1", prompt(70, 4), max_tokens=30, temperature=0))]
    for _ in range(3):
        engine.step(engine.scheduler.schedule())
    handles.append(engine.submit(req("s1", prompt(10, 5), max_tokens=9, seed=1)))
    for _ in range(6):
        engine.step(engine.scheduler.schedule())
    handles.append(engine.submit(req("g2", prompt(40, 3), max_tokens=16, temperature=0)))
    handles.append(engine.submit(req("g3", prompt(33, 6), max_tokens=5, temperature=0)))
    return drive(engine, handles)


def test_lookahead_gives_the_plain_engines_tokens_and_frees_everything():
    plain = staggered(make_engine(False))
    engine = make_engine(True)
    launched = count_lookaheads(engine)
    free0 = engine.kv.allocator.free_pages
    assert staggered(engine) == plain
    assert launched[0] >= 15  # 19: the rounds where every item decoded greedily (none ending)
    assert engine._ahead is None  # every request ended: nothing left in flight
    assert engine.kv.allocator.free_pages == free0 and engine.scheduler.busy_lanes == 0


def test_lookahead_tokens_survive_a_replay_before_they_are_read():
    """A decode graph's argmax is its static output (`ModelRunner.greedy_ids`), overwritten by a replay:
    a round that runs other items before it reads the lookahead's tokens (lanes that joined the decoders)
    must not read them overwritten. Here every run writes its argmax into one shared buffer, as a replay of
    the same graph would (without the copy the round takes first, g1's tokens went wrong from its fifth)."""
    engine = make_engine(True)
    runner, run = engine.runner, engine.runner.run
    static = torch.full((16,), -1, dtype=torch.long)
    last = [None]

    def replaying(rnd, all_rows=False, device_ids=None):
        logits = run(rnd, all_rows, device_ids)
        if logits is not None:
            static[: logits.shape[0]] = logits[:, : engine.sample_vocab].argmax(-1)
        last[0] = logits
        return logits

    def graph_ids(logits, vocab):
        return static[: logits.shape[0]] if logits is last[0] else logits[:, :vocab].argmax(-1)

    runner.run, runner.greedy_ids = replaying, graph_ids
    assert joining(engine) == joining(make_engine(False))


def joining(engine: Engine, **sampling) -> dict:
    """Requests that arrive while another decodes (greedy unless `sampling` says): with the lookahead, the
    rounds they join run their prefill beside the decoder's lookahead outputs."""
    sampling = sampling or dict(temperature=0)
    handles = [engine.submit(req("g1", prompt(20, 4), max_tokens=40, **sampling))]
    for arrival in range(3):
        for _ in range(5):
            engine.step(engine.scheduler.schedule())
        handles.append(engine.submit(req(f"j{arrival}", prompt(12 + arrival, 5 + arrival), max_tokens=12,
                                         **sampling)))
    return drive(engine, handles)


# the server's non-thinking preset, seeded per request (the same draws with and without the lookahead)
PRESET = dict(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5, seed=5)


def test_sampled_rounds_look_ahead_and_draw_the_plain_engines_tokens():
    engine = make_engine(True)
    launched = count_lookaheads(engine)
    out = joining(engine, **PRESET)
    assert out == joining(make_engine(False), **PRESET)
    assert launched[0] >= 20  # most of g1's 40 rounds: its tokens sampled on the device, fed back there
    assert len({t for toks, _ in out.values() for t in toks}) > 10  # (sampled, not one repeated token)


def test_sampled_lookahead_logits_survive_a_replay_before_they_are_read():
    """A decode graph's logits are its static output: every run here writes them into one buffer, as a
    replay of the same graph would; a round that runs joining items before it samples the lookahead's rows
    must sample them as they were."""
    engine = make_engine(True)
    run = engine.runner.run
    static = torch.empty(16, 97)

    def replaying(rnd, all_rows=False, device_ids=None):
        logits = run(rnd, all_rows, device_ids)
        if logits is None:
            return None
        static[: logits.shape[0]] = logits
        return static[: logits.shape[0]]

    engine.runner.run = replaying
    assert joining(engine, **PRESET) == joining(make_engine(False), **PRESET)


def test_lookahead_past_an_end_of_sequence_token_is_dropped():
    ids = prompt(25, 14)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    free_run = drive(e := make_engine(False), [e.submit(GenerationRequest("a", ids, greedy))])["a"][0]
    stop_at = free_run[3]
    engine = make_engine(True, eos_ids=(stop_at,))
    other = prompt(30, 2)
    out = drive(engine, [engine.submit(GenerationRequest("b", ids, greedy)),
                         engine.submit(GenerationRequest("c", other, greedy))])
    assert out["b"] == (free_run[: free_run.index(stop_at) + 1], "stop")
    e = make_engine(False, eos_ids=(stop_at,))
    assert out["c"] == drive(e, [e.submit(GenerationRequest("c", other, greedy))])["c"]


def test_cancel_with_a_lookahead_in_flight():
    engine = make_engine(True, max_concurrency=2)
    free0 = engine.kv.allocator.free_pages
    keep = engine.submit(req("keep", prompt(20, 7), max_tokens=40, temperature=0))
    gone = engine.submit(req("gone", prompt(100, 8), max_tokens=100, temperature=0))
    for _ in range(12):
        engine.step(engine.scheduler.schedule())
    assert engine._ahead is not None and len(engine._ahead.items) == 2
    gone.cancel()
    engine.step(engine.scheduler.schedule())
    assert engine.scheduler.busy_lanes == 1
    assert [it.seq.request.request_id for it in engine._ahead.items] == ["keep"]
    events = []
    while (ev := gone.next_event(0)) is not None:
        events.append(ev)
    assert events[-1].finish_reason == "cancelled"
    kept = drive(engine, [keep])["keep"]
    e = make_engine(False)
    alone = drive(e, [e.submit(req("keep", prompt(20, 7), max_tokens=40, temperature=0))])["keep"]
    assert kept[0][-30:] == alone[0][-30:] and kept[1] == "length"
    assert engine.kv.allocator.free_pages == free0 and engine.scheduler.busy_lanes == 0


def test_a_round_out_of_step_with_the_lookahead_is_refused():
    engine = make_engine(True)
    h = engine.submit(req("x", prompt(8, 1), max_tokens=4, temperature=0))
    engine.step(engine.scheduler.schedule())
    seq = h.seq
    planned = WorkItem(seq, seq.lane, (0,), seq.cached + 1, True)
    ahead = _Lookahead([planned], torch.zeros(1, 8), torch.zeros(1, dtype=torch.long))
    assert ahead.rows(Round([WorkItem(seq, seq.lane, (5,), seq.cached + 1, True)], [], [])) == {0: 0}
    with pytest.raises(RuntimeError, match="out of step"):
        ahead.rows(Round([WorkItem(seq, seq.lane, (5,), seq.cached, True)], [], []))
