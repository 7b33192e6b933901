"""Engine invariants (random hybrid model): chunking, decode = full forward, batching, cancel, admission"""

from __future__ import annotations

import time

import pytest
import torch
from test_engine_fake_model import FakeHybridModel, full_forward_logits

from ninfer.engine.api import GenerationRequest, SamplingParams
from ninfer.engine.engine import Engine, EngineConfig
from ninfer.errors import EngineConfigError, RequestError

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def req(request_id: str, ids: tuple[int, ...], **sampling) -> GenerationRequest:
    return GenerationRequest(request_id, ids, SamplingParams(**sampling))


def make_engine(**kw) -> Engine:
    cfg = dict(max_concurrency=4, max_context=512, kv_capacity=2048, kv_dtype="fp32", prefill_chunk=512)
    cfg.update(kw)
    return Engine.from_model(FakeHybridModel(), EngineConfig(**cfg))


def prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def drive(engine: Engine, handles, max_rounds: int = 10_000) -> dict:
    """Run rounds on this thread until every handle finished; returns request_id -> (tokens, finish)."""
    out = {}
    for _ in range(max_rounds):
        rnd = engine.scheduler.schedule()
        if rnd is not None:
            engine.step(rnd)
        for h in handles:
            while (ev := h.next_event(0)) is not None:
                toks, _ = out.get(h.request_id, ([], None))
                out[h.request_id] = (toks + list(ev.token_ids), ev.finish_reason)
        if all(out.get(h.request_id, (None, None))[1] for h in handles):
            return out
    raise AssertionError("requests did not finish")


def capture_logits(engine: Engine) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    model = engine.model
    original = model.compute_logits

    def record(hidden):
        logits = original(hidden)
        seen.append(logits.clone())
        return logits

    model.compute_logits = record
    return seen


def greedy_logits(model, device: str, dtype: str, kv_dtype: str, prompts: dict[str, tuple[int, ...]],
                  max_tokens: int = 24, chunk: int = 16, graphs: bool = True) -> tuple[dict, dict]:
    """Each prompt alone through an engine over `model`, greedy, EOS ignored: name -> generated tokens, and
    name -> each round's last-position logits (fp32, on the CPU). A decode round replayed from a CUDA graph
    does not call `compute_logits` from Python, so on CUDA only `graphs=False` sees every round's logits."""
    engine = Engine.from_model(model, EngineConfig(max_concurrency=1, max_context=128, kv_capacity=128,
                                                   kv_dtype=kv_dtype, prefill_chunk=chunk, device=device,
                                                   dtype=dtype, cuda_graphs=graphs))
    seen = capture_logits(engine)
    tokens, logits = {}, {}
    try:
        for name, ids in prompts.items():
            start = len(seen)
            h = engine.submit(req(name, ids, max_tokens=max_tokens, temperature=0, ignore_eos=True))
            tokens[name] = drive(engine, [h])[name][0]
            logits[name] = [row.float().reshape(-1, row.shape[-1])[-1].cpu() for row in seen[start:]]
    finally:
        del engine.model.compute_logits
    return tokens, logits


def greedy_with_margins(model, device: str, dtype: str, kv_dtype: str, prompts: dict[str, tuple[int, ...]],
                        max_tokens: int = 24) -> tuple[dict, dict]:
    """`greedy_logits`' tokens without CUDA graphs, and name -> each step's top-1 minus top-2 logit (where
    another engine's numerics may pick differently)."""
    tokens, logits = greedy_logits(model, device, dtype, kv_dtype, prompts, max_tokens, graphs=False)
    margins = {}
    for name, rows in logits.items():
        assert len(rows) == len(tokens[name]), (name, len(rows), len(tokens[name]))
        top2 = torch.stack([row.topk(2).values for row in rows])
        margins[name] = (top2[:, 0] - top2[:, 1]).tolist()
    return tokens, margins


@pytest.mark.parametrize("chunk", [16, 64, 1000])
def test_chunked_prefill_gives_the_full_forward_logits(chunk):
    ids = prompt(150, 1)
    engine = make_engine(prefill_chunk=chunk)
    seen = capture_logits(engine)
    drive(engine, [engine.submit(req("a", ids, max_tokens=1, temperature=0))])
    ref = full_forward_logits(engine.model, list(ids))[-1]
    assert (seen[0][0] - ref).abs().max() < 2e-5


def test_prefill_plus_decode_steps_equal_one_full_forward():
    ids = prompt(70, 2)
    engine = make_engine(prefill_chunk=32)
    seen = capture_logits(engine)
    out = drive(engine, [engine.submit(req("a", ids, max_tokens=12, temperature=0))])
    tokens = out["a"][0]
    step_logits = torch.cat(seen)  # one row per sampled token
    full = full_forward_logits(engine.model, list(ids) + tokens)
    assert step_logits.shape[0] == 12
    assert (step_logits - full[len(ids) - 1: len(ids) + 11]).abs().max() < 2e-5
    assert tokens == full[len(ids) - 1: len(ids) + 11].argmax(-1).tolist()


def test_greedy_output_identical_alone_and_alongside_three_others():
    target = prompt(40, 3)
    alone = make_engine(max_concurrency=1)
    ref = drive(alone, [alone.submit(req("t", target, max_tokens=16, temperature=0))])
    engine = make_engine(max_concurrency=4, prefill_chunk=16)
    handles = [engine.submit(req("o1", prompt(90, 4), max_tokens=30, temperature=0))]
    for _ in range(3):  # o1 is mid-prefill when the others arrive
        engine.step(engine.scheduler.schedule())
    handles.append(engine.submit(req("o2", prompt(10, 5), max_tokens=25, seed=1)))
    for _ in range(4):
        engine.step(engine.scheduler.schedule())
    handles.append(engine.submit(req("t", target, max_tokens=16, temperature=0)))
    handles.append(engine.submit(req("o3", prompt(33, 6), max_tokens=5, top_k=5)))
    out = drive(engine, handles)
    assert out["t"] == ref["t"]
    assert len(out["o1"][0]) == 30 and len(out["o3"][0]) == 5


def test_cancel_mid_decode_returns_pages_and_slot():
    engine = make_engine(max_concurrency=2)
    free0 = engine.kv.allocator.free_pages
    keep = engine.submit(req("keep", prompt(20, 7), max_tokens=40, temperature=0))
    gone = engine.submit(req("gone", prompt(100, 8), max_tokens=100, temperature=0))
    for _ in range(5):
        engine.step(engine.scheduler.schedule())
    used_keep = 1  # 20 + 40 tokens -> one page
    assert engine.kv.allocator.free_pages == free0 - used_keep - 4  # 200 tokens -> 4 pages
    gone.cancel()
    engine.step(engine.scheduler.schedule())  # one round later
    assert engine.kv.allocator.free_pages == free0 - used_keep
    assert engine.scheduler.busy_lanes == 1
    lane_rows = (engine.kv.page_tables[: engine.kv.scratch_lane] >= 0).sum(1).tolist()  # real lanes only
    assert sorted(lane_rows) == [0, 1]
    events = []
    while (ev := gone.next_event(0)) is not None:
        events.append(ev)
    assert events[-1].finish_reason == "cancelled"
    drive(engine, [keep])
    assert engine.kv.allocator.free_pages == free0 and engine.scheduler.busy_lanes == 0


def test_admission_refuses_prompt_plus_max_tokens_over_max_context():
    engine = make_engine(max_context=128, kv_capacity=256)
    with pytest.raises(RequestError) as err:
        engine.submit(req("x", prompt(100, 9), max_tokens=50))
    assert err.value.code == "context_length_exceeded"
    assert "150" in str(err.value) and "128" in str(err.value)


def test_second_request_waits_for_pages_then_completes():
    # capacity 128 tokens = 2 pages; each request reserves 2 pages
    engine = make_engine(max_concurrency=2, max_context=128, kv_capacity=128)
    a = engine.submit(req("a", prompt(60, 10), max_tokens=20, temperature=0))
    b = engine.submit(req("b", prompt(60, 11), max_tokens=20, temperature=0))
    engine.step(engine.scheduler.schedule())
    assert engine.scheduler.busy_lanes == 1 and len(engine.scheduler.pending) == 1
    out = drive(engine, [a, b])
    assert len(out["a"][0]) == 20 and len(out["b"][0]) == 20
    assert engine.kv.allocator.free_pages == 2


def test_overload_and_pending_timeout():
    engine = make_engine(max_concurrency=1, max_pending_requests=1, pending_timeout_ms=50)
    h1 = engine.submit(req("1", prompt(5, 1), max_tokens=200, temperature=0))
    h2 = engine.submit(req("2", prompt(5, 2), max_tokens=3))
    with pytest.raises(RequestError) as err:
        engine.submit(req("3", prompt(5, 3), max_tokens=3))
    assert err.value.code == "server_overloaded"
    engine.step(engine.scheduler.schedule())
    time.sleep(0.08)
    engine.scheduler.schedule()
    ev = h2.next_event(0)
    assert ev.finish_reason == "error" and ev.error_code == "request_queue_timeout"
    h1.cancel()


def test_threaded_engine_streams_and_shutdown_fails_in_flight():
    engine = make_engine(max_concurrency=2).start()
    done = engine.generate(req("a", prompt(30, 12), max_tokens=6, seed=3))
    assert sum(len(e.token_ids) for e in done) == 6 and done[-1].finish_reason == "length"
    assert done[-1].prompt_tokens == 30 and done[-1].time_to_first_token_s > 0
    slow = engine.submit(req("b", prompt(30, 13), max_tokens=400))
    engine.shutdown()
    last = list(slow)[-1]
    assert last.finish_reason in ("error", "length")
    assert engine.stats()["lanes_busy"] == 0
    with pytest.raises(RequestError):
        engine.submit(GenerationRequest("c", prompt(3, 1)))


def test_stop_tokens_eos_and_ignore_eos():
    ids = prompt(25, 14)
    engine = make_engine()
    free_run = drive(engine, [engine.submit(GenerationRequest("a", ids, GREEDY))])["a"][0]
    stop_at = free_run[2]
    engine = Engine.from_model(FakeHybridModel(), EngineConfig(max_context=512, kv_capacity=1024,
                                                               kv_dtype="fp32"), eos_ids=(stop_at,))
    out = drive(engine, [engine.submit(GenerationRequest("b", ids, GREEDY))])
    assert out["b"] == (free_run[:free_run.index(stop_at) + 1], "stop")
    ign = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert drive(engine, [engine.submit(GenerationRequest("c", ids, ign))])["c"] == (free_run, "length")
    st = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=(free_run[4],))
    assert drive(engine, [engine.submit(GenerationRequest("d", ids, st))])["d"][1] == "stop"


def test_engine_config_errors():
    with pytest.raises(EngineConfigError, match="smaller than --max-context"):
        make_engine(max_context=4096, kv_capacity=1024)
    with pytest.raises(EngineConfigError, match="max-concurrency"):
        make_engine(max_concurrency=9)
    with pytest.raises(EngineConfigError, match="kv-dtype"):
        make_engine(kv_dtype="q4")


def test_prefill_chunk_defaults_by_device_and_flags_keep_theirs():
    from ninfer.cli.run import build_parser as run_parser
    from ninfer.cli.serve import build_parser, engine_config

    assert EngineConfig().prefill_chunk == 512
    assert EngineConfig(device="cuda").prefill_chunk == 1024  # the spec's GPU default
    assert EngineConfig(device="cuda:1", prefill_chunk=48).prefill_chunk == 48
    def served(*flags):
        return engine_config(build_parser().parse_args(["m.ninfer", *flags])).prefill_chunk

    assert (served("--device", "cuda"), served("--device", "cpu"), served("--prefill-chunk", "300")) == (
        1024, 512, 300)
    assert run_parser().parse_args(["m.ninfer", "--prompt", "hi"]).prefill_chunk is None  # EngineConfig's


def test_memory_ledger_and_auto_capacity():
    engine = make_engine(kv_capacity="auto", kv_dtype="rk8v4", max_context=300, max_concurrency=2,
                         gpu_memory_limit_mib=2048, kv_headroom_mib=64)
    led = engine.memory_ledger()
    assert led.kv_tokens == 640  # CPU cap: 2 lanes x 300 tokens, rounded up to 64-token pages
    per_token = 2 * 2 * (64 + 2 + 32 + 4)  # 2 KV layers x 2 heads x rk8v4 bytes at head dim 64
    assert led.kv_bytes == 640 * per_token
    spent = led.weights_bytes + led.kv_bytes + led.gdn_bytes + led.workspace_bytes
    assert led.free_bytes == 2048 * 2**20 - spent
    assert "KV 640 tokens (rk8v4)" in led.line() and "free" in led.line()
    with pytest.raises(EngineConfigError, match="auto"):
        make_engine(kv_capacity="auto", gpu_memory_limit_mib=300, kv_headroom_mib=64)


def test_perplexity_matches_a_direct_computation_and_frees_its_pages():
    from ninfer.engine.perplexity import perplexity

    ids = list(prompt(150, 15))
    engine = make_engine()
    logp = torch.log_softmax(full_forward_logits(engine.model, ids)[:-1], -1)
    ref = torch.exp(-logp.gather(1, torch.tensor(ids[1:])[:, None]).mean()).item()
    for chunk in (64, 150):
        ppl, n = perplexity(engine, ids, chunk=chunk)
        assert n == 149 and abs(ppl - ref) / ref < 1e-5
    assert engine.kv.allocator.free_pages == engine.kv.num_pages


@pytest.mark.parametrize("length,offset,n,hq,hkv", [(1, 40, 41, 8, 2), (5, 7, 12, 8, 2), (16, 0, 16, 4, 4)])
def test_causal_attention_against_explicit_softmax(length, offset, n, hq, hkv):
    from ninfer.engine.paged_context import causal_attention

    g = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(length, hq, 64, generator=g), torch.randn(hkv, n, 64, generator=g),
               torch.randn(hkv, n, 64, generator=g))
    kk, vv = k.repeat_interleave(hq // hkv, 0), v.repeat_interleave(hq // hkv, 0)
    scores = torch.einsum("lhd,hnd->hln", q, kk) / 8.0
    allowed = torch.arange(n)[None, :] <= torch.arange(offset, offset + length)[:, None]
    ref = torch.einsum("hln,hnd->lhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vv)
    assert (causal_attention(q, k, v, offset) - ref).abs().max() < 1e-5


@pytest.mark.parametrize("kv_dtype", ["bf16", "rk8v4", "rk4v4"])
def test_batched_paged_decode_kernel_path_equals_the_reference_path(kv_dtype, monkeypatch):
    # the CUDA path (ninfer.kernels.paged_attention, here its CPU fallback) against the per-span reference
    from ninfer.kernels import paged_attention

    calls = []
    original = paged_attention.paged_decode_attention

    def counted(q, *args, **kw):
        calls.append(q.shape[0])
        return original(q, *args, **kw)

    monkeypatch.setattr(paged_attention, "paged_decode_attention", counted)
    outputs = []
    for batched in (False, True):
        engine = make_engine(kv_dtype=kv_dtype, prefill_chunk=32)
        engine.runner.batched_decode = batched
        seen = capture_logits(engine)
        handles = [engine.submit(req(f"r{i}", prompt(20 + 30 * i, 20 + i), max_tokens=12, temperature=0))
                   for i in range(3)]
        out = drive(engine, handles)
        outputs.append((out, torch.cat(seen)))
    assert max(calls) == 3  # three lanes decoded in one call
    assert outputs[0][0] == outputs[1][0]
    assert (outputs[0][1] - outputs[1][1]).abs().max() < 1e-4
