"""The Triton kernels compiled for the GPU vs their references at 27B-like shapes (CUDA only)."""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels import kv_quant
from ninfer.kernels.gdn_decode import gdn_decode, gdn_decode_reference
from ninfer.kernels.gguf_matmul import FMA_FORMATS, KERNEL_FORMATS, quant_matmul, random_gguf_weight
from ninfer.kernels.paged_attention import paged_decode_attention, paged_decode_attention_reference
from ninfer.quant import dequantize

pytestmark = pytest.mark.gpu


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
def test_gguf_matmul_on_gpu(fmt):
    rows, cols = 1040, 5120
    raw = random_gguf_weight(fmt, rows, cols, "cuda")
    w = dequantize(raw.cpu().reshape(-1), "gguf_" + fmt, (rows, cols)).cuda().double()
    schedules = ["sub_n32_s4", "sub_n64", "dequant_mm"] + (["fma_n16_m1_s4", "fma_n16_m4_s4"]
                                                          if fmt in FMA_FORMATS else [])
    for width in (1, 4, 300):
        x = torch.randn(width, cols, device="cuda", dtype=torch.bfloat16)
        for schedule in schedules + [None]:
            if schedule and schedule.startswith("fma") and width > 4:
                continue
            out = quant_matmul(raw, fmt, x, rows, schedule=schedule)
            # bf16 output rounding (2^-9) dominates: H200 runs measured 1.7e-3..2.4e-3
            assert rel(out, x.double() @ w.t()) < 5e-3, (fmt, width, schedule)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
def test_gdn_decode_on_gpu(state_dtype):
    B, T, Hk, Hv, D = 3, 4, 16, 48, 128
    C = 2 * Hk * D + Hv * D
    inputs = dict(
        mixed_qkv=torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16),
        a=torch.randn(B, T, Hv, device="cuda"), b=torch.randn(B, T, Hv, device="cuda"),
        conv_weight=torch.randn(C, 4, device="cuda") * 0.3,
        a_log=torch.log(torch.rand(Hv, device="cuda") * 15 + 1), dt_bias=torch.randn(Hv, device="cuda") - 2,
        conv_slots=torch.randn(5, C, 3, device="cuda"),
        state_slots=(torch.randn(5, Hv, D, D, device="cuda") * 0.1).to(state_dtype))
    ids = torch.tensor([4, 0, 2], device="cuda", dtype=torch.int32)
    ref_in = {k: v.clone() for k, v in inputs.items()}
    ref = gdn_decode_reference(**ref_in, slot_ids=ids, num_key_heads=Hk, return_all_states=True)
    out = gdn_decode(**inputs, slot_ids=ids, num_key_heads=Hk, return_all_states=True)
    tol = 1e-5 if state_dtype == torch.float32 else 1e-4  # H200: 3e-7 and 1.2e-5
    assert rel(out.output, ref.output) < tol
    assert rel(out.states.float(), ref.states.float()) < tol
    assert rel(inputs["state_slots"].float(), ref_in["state_slots"].float()) < tol
    assert torch.equal(inputs["conv_slots"], ref_in["conv_slots"])


@pytest.mark.parametrize("name", ["bf16", "int8", "rk8v4", "rk4v4"])
def test_paged_attention_on_gpu(name):
    fmt = kv_quant.kv_format(name, 256)
    lens = [1000, 64, 333]
    pages = sum(-(-n // 64) for n in lens)
    storage = torch.empty((pages, 4, 64, fmt.token_bytes), dtype=torch.uint8, device="cuda")
    tables = torch.full((3, 16), -1, dtype=torch.int32, device="cuda")
    order = torch.randperm(pages).tolist()
    for lane, n in enumerate(lens):
        for i in range(-(-n // 64)):
            page = order.pop()
            tables[lane, i] = page
            storage[page] = kv_quant.encode_kv(fmt, torch.randn(4, 64, 256, device="cuda"),
                                               torch.randn(4, 64, 256, device="cuda"))
    ids = torch.tensor([2, 0, 1], dtype=torch.int32, device="cuda")
    seq = torch.tensor([lens[2], lens[0], lens[1]], dtype=torch.int32, device="cuda")
    q = torch.randn(3, 24, 256, device="cuda")
    ref = paged_decode_attention_reference(q, storage, tables, ids, seq, fmt)
    out = paged_decode_attention(q, storage, tables, ids, seq, fmt)
    assert rel(out, ref) < 5e-3  # tf32 dots: H200 measured 3e-4..1.1e-3
