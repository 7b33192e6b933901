"""The GDN decode conv run in the epilogue of the GEMV that makes its input (`gdn_decode.ConvEpilogue`)
against the GEMV followed by the conv kernel, and `gdn_decode(conv_done=True)` against the plain decode
step (Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import gemv_case, needs_triton

from ninfer.errors import NinferError
from ninfer.kernels import gdn_decode as gdn
from ninfer.kernels.gemv_q8 import quantize_activation
from ninfer.kernels.gemv_rows import gemv_rows
from ninfer.kernels.gemv_rows_iq import gemv_rows_iq
from ninfer.kernels.gguf_matmul import quant_matmul

pytestmark = [needs_triton, pytest.mark.usefixtures("triton_on_cpu_env")]


def _conv_after(y: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor, slot_ids: torch.Tensor):
    """The unfused path: the conv kernel on the GEMV's first C outputs -> (silu(conv) [M, C], slots)."""
    C = slots.shape[1]
    slots = slots.clone()
    out = torch.empty((y.shape[0], 1, C), dtype=torch.float32)
    gdn._conv_kernel[(y.shape[0], -(-C // 64))](
        y[:, None, :C], weight, slots, slot_ids, out, out, C, y.stride(0), y.stride(0), slots.stride(0),
        slots.stride(1), T=1, TP=1, BLOCK_C=64, STORE_ALL=False)
    return out[:, 0], slots


@pytest.mark.parametrize("fmt,schedule,columns", [("q4_k", "rows_n16_m1_b4_w4_r2_ef", 1),
                                                  ("q4_k", "rows_n4_m2_b4_w1_r2", 2),
                                                  ("q5_k", "rows_n8_m4_b4_w1_r4", 3),
                                                  ("iq3_s", "rows_iq_n4_m1_b4_w1", 1),
                                                  ("iq3_s", "rows_iq_n8_m2_b4_w4", 2)])
def test_gemv_epilogue_runs_the_conv(fmt, schedule, columns):
    """Both builds: the conv operands loaded after the GEMV's loop (one column) or before its wait (more)."""
    rows, channels = 40, 24  # conv channels first (a partial program past them), then z / a / b rows
    raw, x = gemv_case(fmt, rows, 512, columns, seed=columns * 11 + rows)
    xa = quantize_activation(x.to(torch.bfloat16))
    g = torch.Generator().manual_seed(columns)
    weight = torch.randn(channels, 4, generator=g) * 0.4
    slots = torch.randn(4, channels, 3, generator=g)
    slot_ids = torch.tensor([2, 0, 3][:columns], dtype=torch.int32)
    gemv = gemv_rows_iq if fmt == "iq3_s" else gemv_rows
    plain = gemv(raw, fmt, xa, rows, schedule)
    want, want_slots = _conv_after(plain, weight, slots, slot_ids)
    conv = gdn.ConvEpilogue.of(weight, slots, slot_ids)
    y = gemv(raw, fmt, xa, rows, schedule, conv=conv)
    assert conv.applied and torch.equal(y, plain)  # every output stored as before
    # the same fp32 operations on the same bf16 inputs as the conv kernel
    assert torch.allclose(conv.out, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(slots, want_slots)  # each lane's slot moved on by its own input
    assert not torch.equal(slots[1], torch.zeros(channels, 3)) and torch.equal(slots[1], want_slots[1])


def test_conv_epilogue_refused_where_it_cannot_run():
    raw, x = gemv_case("q4_k", 40, 512, 1, seed=4)
    xa = quantize_activation(x)
    slots = torch.randn(2, 24, 3)
    conv = gdn.ConvEpilogue.of(torch.randn(24, 4), slots, torch.tensor([1], dtype=torch.int32))
    for schedule in ("rows_n4_m1_b4_w2_s4", "rowsp_n4_m1_b4_w1"):  # split-K; piece lanes
        with pytest.raises(NinferError, match="cannot run the GDN conv"):
            gemv_rows(raw, "q4_k", xa, 40, schedule, conv=conv)
    assert not conv.applied
    # quant_matmul on the CPU path (no rows route there) leaves it to the conv kernel
    quant_matmul(raw, "q4_k", x, 40, conv=conv)
    assert not conv.applied


def test_conv_route_by_format_and_columns(monkeypatch):
    from ninfer.kernels.gemv_rows import SCHEDULES
    from ninfer.kernels.gguf_matmul import _conv_route

    slots = torch.randn(3, 24, 3)
    two = gdn.ConvEpilogue.of(torch.randn(24, 4), slots, torch.tensor([1, 2], dtype=torch.int32))
    one = gdn.ConvEpilogue.of(torch.randn(24, 4), slots, torch.tensor([1], dtype=torch.int32))
    rows1, rows2 = SCHEDULES["rows_n16_m1_b4_w4_r2_ef"], SCHEDULES["rows_n4_m2_b4_w1_r2"]
    assert _conv_route(one, rows1, "q4_k", 1, 40) is one
    assert _conv_route(two, rows2, "q4_k", 2, 40) is two
    assert _conv_route(two, rows2, "iq3_s", 2, 40) is None  # slower there: the conv kernel runs it
    assert _conv_route(one, rows1, "q6_k", 1, 40) is None  # no conv build for q6_k
    assert _conv_route(two, SCHEDULES["rowsp_n2_m2_b4_w1"], "q4_k", 2, 40) is None  # piece lanes
    monkeypatch.setenv("NINFER_CONV_EPILOGUE", "0")
    assert _conv_route(one, rows1, "q4_k", 1, 40) is None


def test_decode_step_after_the_epilogue_equals_the_plain_step():
    g = torch.Generator().manual_seed(9)
    B, Hk, Hv, Dk, Dv = 2, 1, 2, 16, 8
    C = 2 * Hk * Dk + Hv * Dv
    mixed = torch.randn(B, 1, C, generator=g)
    a, b = torch.randn(B, 1, Hv, generator=g), torch.randn(B, 1, Hv, generator=g)
    weight = torch.randn(C, 4, generator=g) * 0.3
    a_log, dt_bias = torch.rand(Hv, generator=g) + 0.5, torch.randn(Hv, generator=g) - 2.0
    conv_slots = torch.randn(3, C, 3, generator=g)
    state = torch.randn(3, Hv, Dk, Dv, generator=g) * 0.1
    ids = torch.tensor([2, 0], dtype=torch.int32)
    plain_conv, plain_state, fused_state, ref_state = conv_slots.clone(), state.clone(), state.clone(), state
    want = gdn.gdn_decode(mixed, a, b, weight, a_log, dt_bias, plain_conv, plain_state, ids, Hk).output
    done, after = _conv_after(mixed[:, 0], weight, conv_slots, ids)
    assert torch.equal(after, plain_conv)
    got = gdn.gdn_decode(done[:, None], a, b, weight, a_log, dt_bias, after, fused_state, ids, Hk,
                         conv_done=True).output
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert torch.allclose(fused_state, plain_state, rtol=1e-6, atol=1e-6)
    ref = gdn.gdn_decode_reference(done[:, None], a, b, weight, a_log, dt_bias, after, ref_state, ids, Hk,
                                   conv_done=True).output
    assert torch.equal(after, plain_conv)  # conv_done: the conv slots are left as they are
    assert torch.allclose(ref, got, rtol=1e-5, atol=1e-6)
    with pytest.raises(NinferError, match="per-position states"):
        gdn.gdn_decode(done[:, None], a, b, weight, a_log, dt_bias, after, state, ids, Hk, conv_done=True,
                       return_all_states=True)
    with pytest.raises(NinferError, match="defer_state takes one position"):
        gdn.gdn_decode(mixed.expand(B, 2, C), a.expand(B, 2, Hv), b.expand(B, 2, Hv), weight, a_log, dt_bias,
                       conv_slots, state, ids, Hk, defer_state=True)


def test_a_spans_step_after_the_epilogue_equals_the_plain_step():
    """T = 3 positions a lane (a verification span, as the il32 / q4il epilogues run its conv): the
    reference conv over each lane's span, then `gdn_decode(conv_done=True)`, against the plain T-position
    step — the same outputs, recurrent and conv states."""
    from ninfer.kernels import reference

    g = torch.Generator().manual_seed(10)
    B, T, Hk, Hv, Dk, Dv = 2, 3, 1, 2, 16, 8
    C = 2 * Hk * Dk + Hv * Dv
    mixed = torch.randn(B, T, C, generator=g)
    a, b = torch.randn(B, T, Hv, generator=g), torch.randn(B, T, Hv, generator=g)
    weight = torch.randn(C, 4, generator=g) * 0.3
    a_log, dt_bias = torch.rand(Hv, generator=g) + 0.5, torch.randn(Hv, generator=g) - 2.0
    conv_slots = torch.randn(3, C, 3, generator=g)
    state = torch.randn(3, Hv, Dk, Dv, generator=g) * 0.1
    ids = torch.tensor([2, 0], dtype=torch.int32)
    plain_conv, plain_state, fused_state = conv_slots.clone(), state.clone(), state.clone()
    want = gdn.gdn_decode(mixed, a, b, weight, a_log, dt_bias, plain_conv, plain_state, ids, Hk).output
    after = conv_slots.clone()
    done = torch.empty(B, T, C)
    for lane, slot in enumerate(ids.tolist()):
        done[lane], after[slot] = reference.causal_conv1d(mixed[lane], weight, conv_slots[slot])
    assert torch.allclose(after, plain_conv, rtol=1e-6, atol=1e-6) and not torch.equal(after, conv_slots)
    got = gdn.gdn_decode(done, a, b, weight, a_log, dt_bias, after, fused_state, ids, Hk, conv_done=True)
    assert torch.allclose(got.output, want, rtol=1e-5, atol=1e-6)
    assert torch.allclose(fused_state, plain_state, rtol=1e-5, atol=1e-6)
    assert not torch.equal(fused_state, state)


def test_model_decode_with_the_conv_in_the_projection(monkeypatch, tmp_path):
    """The wiring on the tiny q4_k_m model (CPU, reference matmuls): the decode context's `gdn_conv` hook
    reaches the merged GDN input projection, whose matmul (a stand-in here for the rows GEMV: the reference
    product, then the conv in PyTorch) runs it; the layer then mixes with `conv_done` — the same logits and
    states as the conv kernel's path, one and two lanes."""
    import torch.nn.functional as F
    from test_fused_ops import _convert
    from test_graph_decode import Pools, run_forward, tokens

    from ninfer.engine.paged_context import PagedBatchContext
    from ninfer.kernels import gguf_matmul
    from ninfer.models import load_model

    monkeypatch.delenv("NINFER_TRITON_ON_CPU")  # GDN on its references (the interpreter is slow at 128²)
    calls = []

    def matmul(raw, format, x, out_features, conv=None, **kw):
        y = gguf_matmul.quant_matmul_reference(raw, format, x, out_features)
        if conv is not None:
            calls.append(conv.slot_ids.tolist())
            for m, slot in enumerate(conv.slot_ids.tolist()):
                taps = torch.cat([conv.slots[slot], y[m, :conv.channels].float()[:, None]], dim=1)  # [C, 4]
                conv.out[m] = F.silu((taps * conv.weight).sum(1))
                conv.slots[slot] = taps[:, 1:]
            conv.applied = True
        return y

    monkeypatch.setattr(gguf_matmul, "quant_matmul", matmul)
    model = load_model(_convert(tmp_path / "q4km.ninfer", "q4_k_m"), quantized_weights=True, load_mtp=False)
    fused, plain = Pools(model), None
    for batch in ([(0, tokens(9, 1), 0), (1, tokens(5, 2), 0)], [(0, tokens(1, 3), 9)],
                  [(0, tokens(1, 4), 10), (1, tokens(1, 5), 5)]):
        if plain is None:  # the prefill round: spans longer than a token, no conv hook
            got = run_forward(model, fused, batch, gdn_kernels=True)
            assert not calls
            plain = fused.clone()
            continue
        got = run_forward(model, fused, batch, gdn_kernels=True)
        with monkeypatch.context() as m:
            m.setattr(PagedBatchContext, "gdn_conv", lambda self, layer, params: None)
            want = run_forward(model, plain, batch, gdn_kernels=True)
        assert calls and calls[-1] == [lane for lane, _, _ in batch]  # every GDN layer, the batch's lanes
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for layer in range(len(fused.states.conv)):
            torch.testing.assert_close(fused.states.conv[layer], plain.states.conv[layer])
            torch.testing.assert_close(fused.states.recurrent[layer], plain.states.recurrent[layer])
