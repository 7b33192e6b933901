"""The Qwen3.5 model loaded from real `.ninfer` artifacts (converted here with `ninfer-convert`) against
transformers and llama.cpp references in the fixtures.

Measured on this machine (fp32 compute, max |Δlogit|, logit std ≈ 1):
  bf16 GGUF and HF-checkpoint artifacts vs transformers fp32: ≤ 7.5e-6; 24-token greedy identical.
  every GGUF type vs `tfdq` (transformers fp32 on the same dequantised weights): ≤ 8.1e-6, greedy identical.
  vs llama.cpp (p1 all positions, p2/p3 last): bf16 0.087, q8_0 0.270, q6_k 0.651, q4_k_m 0.501,
  iq4_xs 0.447, iq3_s 0.547 — the fixture README's "llama.cpp vs HF-on-dequantized" column to 3 digits.
  top-1 agreement with llama.cpp over p1's 20 positions: bf16 1.00, q8_0 0.90, q6_k 0.75, q4_k_m 0.90,
  iq4_xs 1.00, iq3_s 0.70 (random weights: many near-ties).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TINY_GGUF, TINY_HF
from simple_context import SequenceCache, SimpleContext, greedy, prefill_logits, single_thread

from ninfer.artifact import open_artifact
from ninfer.cli.convert import main as convert_main
from ninfer.models import load_model

GGUF_TYPES = ("bf16", "q8_0", "q6_k", "q4_k_m", "iq4_xs", "iq3_s")
TF_ATOL = 2e-5  # measured ≤ 8.1e-6 against transformers / tfdq
# fixture README, "llama.cpp vs HF-on-dequantized-GGUF", max over the three prompts
LLAMA_CPP_MAX = {
    "bf16": 0.087, "q8_0": 0.270, "q6_k": 0.651, "q4_k_m": 0.501, "iq4_xs": 0.447, "iq3_s": 0.547,
}
LLAMA_CPP_SLACK = 0.005  # llama.cpp logits are stored as fp16 (spacing 2^-8 near |logit| 2..4)
TOP1_MIN = 0.65  # measured ≥ 0.70 on every type


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    out = tmp_path_factory.mktemp("models_art")
    paths = {}
    for t in GGUF_TYPES:
        f = TINY_GGUF / f"model-{t}.gguf"
        paths[t] = out / f"{t}.ninfer"
        rc = convert_main(["--recipe", "qwen3_5_gguf", "--source", f"gguf={f}", "--source", f"mtp={f}",
                           "--components", "text,mtp", "--model", str(TINY_HF), "--out", str(paths[t]),
                           "--quiet"])  # fmt: skip
        assert rc == 0
    paths["hf"] = out / "hf.ninfer"
    rc = convert_main(["--recipe", "qwen3_5", "--model", str(TINY_HF), "--source", f"mtp={TINY_HF}",
                       "--components", "text,mtp", "--out", str(paths["hf"]), "--quiet"])  # fmt: skip
    assert rc == 0
    return paths


@pytest.fixture(scope="module")
def ref(tiny_dir):
    return dict(np.load(tiny_dir / "reference" / "reference.npz"))


def _model(artifacts, kind):
    return load_model(open_artifact(artifacts[kind]))


@pytest.mark.parametrize("kind", ["bf16", "hf"])
def test_unquantized_artifacts_match_transformers(artifacts, ref, kind):
    model = _model(artifacts, kind)
    p1 = prefill_logits(model, ref["p1_ids"].tolist())
    torch.testing.assert_close(p1, torch.from_numpy(ref["p1_tf_logits"]), rtol=0, atol=TF_ATOL)
    for p in ("p2", "p3"):
        last = prefill_logits(model, ref[f"{p}_ids"].tolist())[-1]
        torch.testing.assert_close(last, torch.from_numpy(ref[f"{p}_tf_logits_last"]), rtol=0, atol=TF_ATOL)
    for p in ("p1", "p2", "p3"):
        assert greedy(model, ref[f"{p}_ids"].tolist(), 24) == ref[f"{p}_tf_greedy"].tolist(), p


@pytest.mark.parametrize("wtype", GGUF_TYPES)
def test_gguf_artifacts_match_tfdq_and_llama_cpp(artifacts, ref, wtype):
    model = _model(artifacts, wtype)
    p1 = prefill_logits(model, ref["p1_ids"].tolist())
    llcpp_p1 = torch.from_numpy(ref[f"p1_llcpp_{wtype}_logits"].astype(np.float32))
    bound = LLAMA_CPP_MAX[wtype] + LLAMA_CPP_SLACK
    assert (p1 - llcpp_p1).abs().max() <= bound
    top1 = (p1.argmax(-1) == llcpp_p1.argmax(-1)).float().mean().item()
    assert top1 >= TOP1_MIN, f"{wtype}: top-1 agreement with llama.cpp {top1:.2f}"
    for p in ("p1", "p2", "p3"):
        last = p1[-1] if p == "p1" else prefill_logits(model, ref[f"{p}_ids"].tolist())[-1]
        tfdq = torch.from_numpy(ref[f"{p}_tfdq_{wtype}_logits_last"])
        torch.testing.assert_close(last, tfdq, rtol=0, atol=TF_ATOL)
        if p != "p1":
            llcpp = torch.from_numpy(ref[f"{p}_llcpp_{wtype}_logits_last"].astype(np.float32))
            assert (last - llcpp).abs().max() <= bound
        assert greedy(model, ref[f"{p}_ids"].tolist(), 24) == ref[f"{p}_tfdq_{wtype}_greedy"].tolist(), p


def test_mtp_from_gguf_equals_mtp_from_hf_checkpoint(artifacts, ref):
    """The GGUF's nextn tensors (eh_proj, enorm/hnorm, shared_head_norm, blk.4.*) give the same MTP head
    as the HF checkpoint's mtp.* weights (bf16 both ways, so exactly the same numbers up to fp32 rounding)."""
    ids = ref["p2_ids"].tolist()
    outs = []
    for kind in ("bf16", "hf"):
        model = _model(artifacts, kind)
        assert model.mtp is not None and model.cache_spec.total_kv_layers == 2
        cache = SequenceCache(model.cache_spec, mtp=True)
        ctx = SimpleContext([cache], [len(ids)], [0])
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), ctx)
        nxt = torch.tensor(ids[1:] + [int(model.compute_logits(hidden[-1:]).argmax())])
        mtp_hidden = model.mtp(hidden, nxt, torch.arange(len(ids)), SimpleContext([cache], [len(ids)], [0]))
        outs.append(model.mtp.compute_logits(mtp_hidden))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=TF_ATOL)


def test_load_without_mtp(artifacts):
    model = load_model(open_artifact(artifacts["q8_0"]), load_mtp=False)
    assert model.mtp is None and model.cache_spec.mtp_kv_layers == 0
    assert model.output_head.input_columns is None
    gdn_out = model.layers[0].mixer.output
    assert gdn_out.input_columns is not None and sorted(gdn_out.input_columns.tolist()) == list(range(768))
