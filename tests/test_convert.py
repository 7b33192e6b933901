"""ninfer-convert on the qwen35-tiny fixtures: every GGUF type, the HF checkpoint, MTP and vision.

References are not ours: the HF safetensors checkpoint, and gguf-py's reader + `gguf.quants.dequantize` of
each source tensor with the fixture README's conventions undone here by reshapes (independently of the
converter's index gathers).
"""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch
from conftest import TINY_GGUF, TINY_HF
from safetensors.torch import load_file

from ninfer.artifact import open_artifact
from ninfer.cli.convert import main as convert_main
from ninfer.cli.inspect import main as inspect_main

GGUF_TYPES = ("bf16", "q8_0", "q4_k_m", "q6_k", "iq4_xs", "iq3_s")
HIDDEN, LAYERS, HEADS, HEAD_DIM, NK, NV, DK, DV = 256, 4, 4, 128, 2, 6, 128, 128
FULL = {3}
P = "model.language_model."


def convert(args, tmp_path=None) -> int:
    return convert_main([*args, "--quiet"])


@pytest.fixture(scope="module")
def hf():
    return {k: v.float() for k, v in load_file(TINY_HF / "model.safetensors").items()}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each fixture GGUF converted with text, vision and MTP (the issue's acceptance command)."""
    out = tmp_path_factory.mktemp("conv")
    paths = {}
    for t in GGUF_TYPES:
        f = TINY_GGUF / f"model-{t}.gguf"
        paths[t] = out / f"{t}.ninfer"
        rc = convert(["--recipe", "qwen3_5_gguf", "--source", f"gguf={f}", "--source", f"mtp={f}",
                      "--source", f"vision={TINY_GGUF / 'mmproj-bf16.gguf'}",
                      "--components", "text,vision,mtp",
                      "--model", str(TINY_HF), "--out", str(paths[t])])  # fmt: skip
        assert rc == 0
    return paths


# ---- independent references ---------------------------------------------------------------------


def _untile_heads(x: np.ndarray, dim: int) -> np.ndarray:
    """Rows in GGUF tiled value-head order [r][k] -> HF grouped order [k][r] (heads of `dim` rows)."""
    ratio = NV // NK
    rest = x.shape[1:]
    return x.reshape(ratio, NK, dim, *rest).transpose(1, 0, 2, *range(3, 3 + len(rest))).reshape(x.shape)


def gguf_reference(path) -> dict[str, np.ndarray]:
    """Logical name -> fp32 values in HF convention, from gguf-py's reader and reference dequantisation."""
    reader = gguf.GGUFReader(path)
    raw = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32) for t in reader.tensors}
    ref = {
        "text/token_embedding": raw["token_embd.weight"],
        "text/output_head": raw["output.weight"],
        "text/final_norm": raw["output_norm.weight"] - 1,
    }

    def block(b: str, out: str, gdn: bool) -> None:
        ref[f"{out}/input_norm"] = raw[f"{b}.attn_norm.weight"] - 1
        ref[f"{out}/post_attention_norm"] = raw[f"{b}.post_attention_norm.weight"] - 1
        for role in ("gate", "up", "down"):
            ref[f"{out}/mlp/{role}"] = raw[f"{b}.ffn_{role}.weight"]
        if gdn:
            qkv = raw[f"{b}.attn_qkv.weight"]
            ref[f"{out}/gdn/query"], ref[f"{out}/gdn/key"] = qkv[: NK * DK], qkv[NK * DK : 2 * NK * DK]
            ref[f"{out}/gdn/value"] = _untile_heads(qkv[2 * NK * DK :], DV)
            conv = raw[f"{b}.ssm_conv1d.weight"]
            ref[f"{out}/gdn/convolution"] = np.concatenate(
                [conv[: 2 * NK * DK], _untile_heads(conv[2 * NK * DK :], DV)]
            )
            ref[f"{out}/gdn/z"] = _untile_heads(raw[f"{b}.attn_gate.weight"], DV)
            ref[f"{out}/gdn/a_projection"] = _untile_heads(raw[f"{b}.ssm_alpha.weight"], 1)
            ref[f"{out}/gdn/b_projection"] = _untile_heads(raw[f"{b}.ssm_beta.weight"], 1)
            ref[f"{out}/gdn/dt_bias"] = _untile_heads(raw[f"{b}.ssm_dt.bias"], 1)
            ref[f"{out}/gdn/a_log"] = np.log(-_untile_heads(raw[f"{b}.ssm_a"], 1))
            ref[f"{out}/gdn/norm"] = raw[f"{b}.ssm_norm.weight"]
            # stored out_proj keeps tiled input columns; HF-convention reference untiles them
            ref[f"{out}/gdn/output"] = _untile_heads(raw[f"{b}.ssm_out.weight"].T, DV).T
        else:
            q = raw[f"{b}.attn_q.weight"].reshape(HEADS, 2, HEAD_DIM, HIDDEN)
            ref[f"{out}/attention/query"] = q[:, 0].reshape(-1, HIDDEN)
            ref[f"{out}/attention/gate"] = q[:, 1].reshape(-1, HIDDEN)
            for role, name in (("key", "attn_k"), ("value", "attn_v"), ("output", "attn_output")):
                ref[f"{out}/attention/{role}"] = raw[f"{b}.{name}.weight"]
            ref[f"{out}/attention/query_norm"] = raw[f"{b}.attn_q_norm.weight"] - 1
            ref[f"{out}/attention/key_norm"] = raw[f"{b}.attn_k_norm.weight"] - 1

    for i in range(LAYERS):
        block(f"blk.{i}", f"text/layers/{i}", i not in FULL)
    block("blk.4", "mtp/layers/0", False)
    ref["mtp/input_projection"] = raw["blk.4.nextn.eh_proj.weight"]
    ref["mtp/embedding_norm"] = raw["blk.4.nextn.enorm.weight"] - 1
    ref["mtp/hidden_norm"] = raw["blk.4.nextn.hnorm.weight"] - 1
    ref["mtp/final_norm"] = raw["blk.4.nextn.shared_head_norm.weight"] - 1
    return ref


def hf_name(logical: str) -> str:
    """The HF checkpoint tensor behind a logical text/MTP name (query/gate/q/k/v give their fused parent)."""
    fixed = {
        "text/token_embedding": P + "embed_tokens.weight",
        "text/output_head": "lm_head.weight",
        "text/final_norm": P + "norm.weight",
        "mtp/input_projection": "mtp.fc.weight",
        "mtp/embedding_norm": "mtp.pre_fc_norm_embedding.weight",
        "mtp/hidden_norm": "mtp.pre_fc_norm_hidden.weight",
        "mtp/final_norm": "mtp.norm.weight",
    }
    if logical in fixed:
        return fixed[logical]
    parts = logical.split("/")
    base = f"{P}layers.{parts[2]}" if parts[0] == "text" else "mtp.layers.0"
    role = "/".join(parts[3:])
    table = {"input_norm": "input_layernorm.weight", "post_attention_norm": "post_attention_layernorm.weight",
             "mlp/gate": "mlp.gate_proj.weight", "mlp/up": "mlp.up_proj.weight",
             "mlp/down": "mlp.down_proj.weight",
             "attention/query": "self_attn.q_proj.weight", "attention/gate": "self_attn.q_proj.weight",
             "attention/key": "self_attn.k_proj.weight", "attention/value": "self_attn.v_proj.weight",
             "attention/output": "self_attn.o_proj.weight", "attention/query_norm": "self_attn.q_norm.weight",
             "attention/key_norm": "self_attn.k_norm.weight", "gdn/query": "linear_attn.in_proj_qkv.weight",
             "gdn/key": "linear_attn.in_proj_qkv.weight", "gdn/value": "linear_attn.in_proj_qkv.weight",
             "gdn/z": "linear_attn.in_proj_z.weight", "gdn/a_projection": "linear_attn.in_proj_a.weight",
             "gdn/b_projection": "linear_attn.in_proj_b.weight", "gdn/a_log": "linear_attn.A_log",
             "gdn/dt_bias": "linear_attn.dt_bias", "gdn/convolution": "linear_attn.conv1d.weight",
             "gdn/norm": "linear_attn.norm.weight", "gdn/output": "linear_attn.out_proj.weight"}  # fmt: skip
    return f"{base}.{table[role]}"


def hf_value(hf: dict, logical: str) -> torch.Tensor:
    t = hf[hf_name(logical)]
    role = logical.rsplit("/", 1)[-1]
    if logical.endswith(("attention/query", "attention/gate")):
        t = t.view(HEADS, 2, HEAD_DIM, HIDDEN)[:, 0 if role == "query" else 1].reshape(-1, HIDDEN)
    elif "/gdn/" in logical and role in ("query", "key", "value"):
        start = {"query": 0, "key": NK * DK, "value": 2 * NK * DK}[role]
        t = t[start : start + (NV * DV if role == "value" else NK * DK)]
    elif role == "convolution":
        t = t.squeeze(1)
    return t


def _artifact_values(art, name: str) -> torch.Tensor:
    """Dequantised binding in HF convention: GDN output columns put back with the recorded input_columns."""
    values = art.tensor(name).dequantize()
    cols = art.input_columns(name)
    if cols is not None:
        undone = torch.empty_like(values)
        undone[:, cols] = values
        values = undone
    return values


# ---- acceptance: numeric round trip ---------------------------------------------------------------


@pytest.mark.parametrize("wtype", GGUF_TYPES)
def test_every_parameter_matches_gguf_reference(converted, wtype):
    art = open_artifact(converted[wtype])
    ref = gguf_reference(TINY_GGUF / f"model-{wtype}.gguf")
    names = [n for n in art.names() if n.startswith(("text/", "mtp/"))]
    assert sorted(names) == sorted(ref), "every text/MTP parameter is bound, nothing more"
    for name in names:
        got = _artifact_values(art, name).numpy()
        # same bytes, same dequantisation: exact (a_log / norms recomputed in fp32: a few ulp)
        np.testing.assert_allclose(got, ref[name], rtol=2e-7, atol=2e-7, err_msg=name)


# Worst ||artifact - HF|| / ||HF|| over all quantized parameters, measured on these fixtures (q4_k_m 0.073,
# q6_k 0.018, iq4_xs 0.079, iq3_s 0.170), x1.5. Shuffling value heads of gdn/value gives 0.82..1.18 (random
# weights), so these bounds also prove the row/column mapping of the low-bit files.
HF_REL_TOL = {"q4_k_m": 0.11, "q6_k": 0.028, "iq4_xs": 0.12, "iq3_s": 0.25}


@pytest.mark.parametrize("wtype", GGUF_TYPES)
def test_every_parameter_matches_hf_checkpoint(converted, hf, wtype):
    art = open_artifact(converted[wtype])
    for name in (n for n in art.names() if n.startswith(("text/", "mtp/"))):
        got = _artifact_values(art, name)
        want = hf_value(hf, name).reshape(got.shape)
        fmt = art.tensor(name).format
        if fmt in ("bf16", "f32"):
            # bf16 weights carried as is; 1+w norms and -exp(A_log) come back through fp32 rounding
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)
        elif fmt == "gguf_q8_0":
            # q8_0 (per block of 32, d = amax/127): codes round x/d (error d/2), then d is stored as fp16
            # (rel. error 2^-11, times |code| <= 127): |error| <= d * (0.5 + 127 * 2^-11); measured 0.537 d
            blocks = want.reshape(-1, 32)
            bound = blocks.abs().amax(dim=1, keepdim=True) / 127 * (0.5 + 127 * 2**-11) + 1e-7
            assert bool(((got.reshape(-1, 32) - blocks).abs() <= bound).all()), name
        else:
            rel = ((got - want).norm() / want.norm()).item()
            assert rel < HF_REL_TOL[wtype], (name, fmt, rel)


def test_quantized_tensors_are_carried_byte_for_byte(converted):
    art = open_artifact(converted["iq3_s"])
    reader = gguf.GGUFReader(TINY_GGUF / "model-iq3_s.gguf")
    raw = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert np.array_equal(art.tensor("text/layers/0/mlp/down").data.numpy(), raw["blk.0.ffn_down.weight"])
    assert art.tensor("text/layers/0/mlp/down").format == "gguf_iq3_s"
    # a row gather moves whole ggml rows: gate = rows D..2D of head 0 in attn_q
    gate = art.tensor("text/layers/3/attention/gate").data.numpy()
    assert np.array_equal(gate[:HEAD_DIM], raw["blk.3.attn_q.weight"][HEAD_DIM : 2 * HEAD_DIM])


def test_input_columns_and_layout_details(converted):
    art = open_artifact(converted["bf16"])
    cols = art.input_columns("text/layers/0/gdn/output")
    ratio = NV // NK
    t = torch.arange(NV)
    expected = (((t % NK) * ratio + t // NK)[:, None] * DV + torch.arange(DV)).reshape(-1)
    assert torch.equal(cols, expected)
    uses = art.directory["uses"]
    assert [u["parameter"] for u in uses] == [f"text/layers/{i}/gdn/output" for i in range(3)]
    assert len({u["auxiliaries"]["input_columns"] for u in uses}) == 1, "identical permutations stored once"
    # GDN q/k/v are row ranges of one fused parent
    objs = {art.bindings[f"text/layers/0/gdn/{r}"]["parts"][0]["object"] for r in ("query", "key", "value")}
    assert len(objs) == 1
    assert art.components["mtp"].config == {"num_layers": 1, "layer_index": 4}
    assert art.components["text"].config["architecture"] == "qwen3_5"
    assert art.components["text"].config["hidden_size"] == HIDDEN
    assert art.components["vision"].config["image_token_id"] == 3980
    for role in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert art.resource("text", role) == (TINY_HF / role).read_bytes()
    for role in ("preprocessor_config.json", "video_preprocessor_config.json"):
        assert art.resource("vision", role) == (TINY_HF / role).read_bytes()
    prov = art.provenance
    assert prov["recipe"] == "qwen3_5_gguf" and prov["sources"]["gguf"]["bytes"] > 0
    assert len(prov["sources"]["gguf"]["header_sha256"]) == 64
    report = json.loads(converted["bf16"].with_name("bf16.ninfer.conversion.json").read_text())
    assert report["objects"] == len(art.directory["objects"])


def test_vision_from_mmproj_matches_hf(converted, hf):
    art = open_artifact(converted["q8_0"])
    pairs = {
        "vision/patch_embedding/weight": "patch_embed.proj.weight",
        "vision/patch_embedding/bias": "patch_embed.proj.bias",
        "vision/position_embedding": "pos_embed.weight",
        "vision/merger/norm/weight": "merger.norm.weight",
        "vision/merger/norm/bias": "merger.norm.bias",
        "vision/merger/fc1/weight": "merger.linear_fc1.weight",
        "vision/merger/fc1/bias": "merger.linear_fc1.bias",
        "vision/merger/fc2/weight": "merger.linear_fc2.weight",
        "vision/merger/fc2/bias": "merger.linear_fc2.bias",
    }
    for i in range(2):
        for logical, name in (
            ("attention/qkv", "attn.qkv"),
            ("attention/output", "attn.proj"),
            ("mlp/fc1", "mlp.linear_fc1"),
            ("mlp/fc2", "mlp.linear_fc2"),
            ("norm1", "norm1"),
            ("norm2", "norm2"),
        ):
            for kind in ("weight", "bias"):
                pairs[f"vision/layers/{i}/{logical}/{kind}"] = f"blocks.{i}.{name}.{kind}"  # fmt: skip
    assert sorted(n for n in art.names() if n.startswith("vision/")) == sorted(pairs)
    for logical, name in pairs.items():
        # mmproj stores bf16 or exact f32 copies of the bf16 checkpoint: equal
        torch.testing.assert_close(
            art.tensor(logical).dequantize(), hf["model.visual." + name], rtol=0, atol=0
        )


def test_hf_checkpoint_converts_and_matches(tmp_path, hf):
    out = tmp_path / "hf.ninfer"
    rc = convert(
        [
            "--recipe",
            "qwen3_5",
            "--model",
            str(TINY_HF),
            "--source",
            f"mtp={TINY_HF}",
            "--components",
            "text,vision,mtp",
            "--name",
            "tiny-hf",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    art = open_artifact(out)
    assert art.metadata["name"] == "tiny-hf"
    names = [n for n in art.names() if n.startswith(("text/", "mtp/"))]
    assert sorted(names) == sorted(gguf_reference(TINY_GGUF / "model-bf16.gguf"))
    for name in names:
        assert art.tensor(name).format == "bf16"
        assert art.input_columns(name) is None
        got = art.tensor(name).dequantize()
        torch.testing.assert_close(got, hf_value(hf, name).reshape(got.shape), rtol=0, atol=0, msg=name)
    torch.testing.assert_close(
        art.tensor("vision/patch_embedding/weight").dequantize(),
        hf["model.visual.patch_embed.proj.weight"],
        rtol=0,
        atol=0,
    )


def test_chunk_size_and_copy_path_do_not_change_the_payload(tmp_path, monkeypatch):
    """Small chunks through the portable read path == big chunks through the kernel copy (where present)."""
    f = TINY_GGUF / "model-q6_k.gguf"
    outs = []
    for rows in (100000, 7):
        if rows == 7:
            monkeypatch.delattr(os, "copy_file_range", raising=False)
        out = tmp_path / f"r{rows}.ninfer"
        assert (
            convert(
                [
                    "--recipe",
                    "qwen3_5_gguf",
                    "--source",
                    f"gguf={f}",
                    "--model",
                    str(TINY_HF),
                    "--rows-per-chunk",
                    str(rows),
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        outs.append(open_artifact(out))
    a, b = outs
    assert a.directory["objects"] == b.directory["objects"]
    size = a.path.stat().st_size
    payload = size - a.directory["files"][0]["payload_bytes"]
    assert a.path.read_bytes()[payload:] == b.path.read_bytes()[payload:]


def test_final_lines_and_inspect(tmp_path, capsys):
    out = tmp_path / "m.ninfer"
    f = TINY_GGUF / "model-q8_0.gguf"
    assert (
        convert(
            ["--recipe", "qwen3_5_gguf", "--source", f"gguf={f}", "--model", str(TINY_HF), "--out", str(out)]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    n_objects = len(open_artifact(out).directory["objects"])
    assert lines[0] == f"wrote {out}" and lines[1] == f"{n_objects} objects" and lines[2] == "1 files"
    assert lines[3].endswith(" s") and float(lines[3].split()[0]) >= 0
    assert out.with_name("m.ninfer.conversion.json").is_file()

    assert inspect_main([str(out)]) == 0
    text = capsys.readouterr().out
    assert (
        "component text (qwen3_5)" in text and "gguf_q8_0" in text and "metadata.recipe: qwen3_5_gguf" in text
    )
    assert inspect_main([str(out), "--objects"]) == 0
    text = capsys.readouterr().out
    assert "text/layers/3/attention/gate" in text and "use text/layers/0/gdn/output" in text
    assert inspect_main([str(out), "--json", "--objects"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["objects"] == n_objects and info["directory"]["files"][0]["path"] is None
