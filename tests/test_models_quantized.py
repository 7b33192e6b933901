"""The model with quantized projections (`load_model(..., quantized_weights=True)`): GGUF blocks stay as
stored and every projection runs `kernels.gguf_matmul.quant_matmul`; and the model on a CUDA device.

CPU: the wiring (raw blocks, format, recorded input columns) is checked with the matmul's reference
(dequantise + fp32 matmul), which must equal the dense model to fp32 rounding. GPU (marked `gpu`): the
Triton kernels (fp16 dot operands) against transformers on the dequantised GGUF (`tfdq`), and the dense
fp32 model on CUDA against transformers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TINY_GGUF, TINY_HF
from simple_context import SequenceCache, SimpleContext, prefill_logits, single_thread

from ninfer.artifact import open_artifact
from ninfer.cli.convert import main as convert_main
from ninfer.kernels import gguf_matmul
from ninfer.models import load_model
from ninfer.models.weights import merged_projections

TYPES = ("q8_0", "q4_k_m", "iq3_s")
FP32_ATOL = 2e-5
# measured on an H200 (max over p1..p3, last position) vs tfdq: q8_0 7.9e-3, q4_k_m 1.8e-2, iq3_s 5.3e-3
# (fp16 dot operands in the Triton kernels); the dense fp32 model on CUDA: ≤ 1.0e-5
GPU_QUANT_ATOL = 0.05


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    out = tmp_path_factory.mktemp("quantized")
    paths = {}
    for t in TYPES:
        f = TINY_GGUF / f"model-{t}.gguf"
        paths[t] = out / f"{t}.ninfer"
        rc = convert_main(["--recipe", "qwen3_5_gguf", "--source", f"gguf={f}", "--components", "text",
                           "--model", str(TINY_HF), "--out", str(paths[t]), "--quiet"])  # fmt: skip
        assert rc == 0
    return paths


@pytest.fixture(scope="module")
def ref(tiny_dir):
    return dict(np.load(tiny_dir / "reference" / "reference.npz"))


@pytest.mark.parametrize("wtype", TYPES)
def test_quantized_projections_wired_like_dense(artifacts, ref, wtype, monkeypatch):
    calls = []

    def reference_matmul(raw, format, x, out_features, **kw):
        calls.append(format)
        return gguf_matmul.quant_matmul_reference(raw, format, x, out_features)

    monkeypatch.setattr(gguf_matmul, "quant_matmul", reference_matmul)
    art = open_artifact(artifacts[wtype])
    with merged_projections(False):  # one Linear per stored projection (merging: tests/test_fused_ops.py)
        quant = load_model(art, quantized_weights=True)
    dense = load_model(art)
    linears = [m for m in quant.modules() if hasattr(m, "raw")]
    assert all(m.raw is not None and m.weight is None for m in linears if m.format.startswith("gguf_"))
    assert sum(m.raw is not None for m in linears) == 40  # every projection, the untied head, the embedding
    ids = ref["p2_ids"].tolist()
    torch.testing.assert_close(prefill_logits(quant, ids), prefill_logits(dense, ids), rtol=0, atol=FP32_ATOL)
    assert {f.removeprefix("gguf_") for f in calls} <= {"q8_0", "q4_k", "q6_k", "iq3_s"} and calls


def _logits_on(model, ids: list[int], device: str) -> torch.Tensor:
    cache = SequenceCache(model.cache_spec)
    for st in cache.gdn:
        st.conv, st.recurrent = st.conv.to(device), st.recurrent.to(device)
    ctx = SimpleContext([cache], [len(ids)], [0])
    hidden = model(torch.tensor(ids, device=device), torch.arange(len(ids), device=device), ctx)
    return model.compute_logits(hidden).cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("wtype", TYPES)
def test_quantized_kernels_on_cuda_match_tfdq(artifacts, ref, wtype):
    model = load_model(open_artifact(artifacts[wtype]), device="cuda", quantized_weights=True)
    for p in ("p1", "p2", "p3"):
        last = _logits_on(model, ref[f"{p}_ids"].tolist(), "cuda")[-1]
        tfdq = torch.from_numpy(ref[f"{p}_tfdq_{wtype}_logits_last"])
        assert (last - tfdq).abs().max() <= GPU_QUANT_ATOL, p


@pytest.mark.gpu
def test_dense_fp32_on_cuda_matches_transformers(artifacts, ref):
    model = load_model(open_artifact(artifacts["q8_0"]), device="cuda")
    for p in ("p1", "p2", "p3"):
        last = _logits_on(model, ref[f"{p}_ids"].tolist(), "cuda")[-1]
        tfdq = torch.from_numpy(ref[f"{p}_tfdq_q8_0_logits_last"])
        torch.testing.assert_close(last, tfdq, rtol=0, atol=FP32_ATOL)
