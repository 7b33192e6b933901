"""Dense GGUF recipes (qwen2_gguf, llama_gguf): synthetic GGUFs written the way llama.cpp's converter lays
them out (fast), and the two real small models (slow group), each parameter checked against transformers'
GGUF loader (gguf-py dequantisation + its llama q/k reverse permutation)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import TINY_GGUF
from realmodels import qwen25_coder_gguf, smollm2_gguf
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from ninfer.artifact import open_artifact
from ninfer.cli.convert import main as convert_main
from ninfer.convert import ConvertRequest, convert
from ninfer.convert.gguf_tokenizer import tokenizer_resources_from_gguf
from ninfer.convert.recipes.dense import unpermute_rope_rows
from ninfer.convert.sources import open_gguf
from ninfer.errors import ConversionError, GGUFError
from ninfer.quant import dequantize

Q8 = gguf.GGMLQuantizationType.Q8_0
F32 = gguf.GGMLQuantizationType.F32


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama q/k rows: per head, interleave the two rotary halves."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_reference(name: str, values: np.ndarray, heads: int, kv_heads: int, arch: str) -> torch.Tensor:
    """transformers' GGUF loader view of a dequantised tensor (llama q/k rows reverse-permuted)."""
    if arch == "llama":
        cfg = {"num_attention_heads": heads, "num_key_value_heads": kv_heads}
        values = LlamaTensorProcessor(config=cfg).process(values, name).weights
    return torch.from_numpy(np.array(values, dtype=np.float32))


# ---- synthetic GGUFs ----------------------------------------------------------------------------

GEO = {"hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 96, "layers": 2, "vocab": 4096}


def write_dense_gguf(path: Path, arch: str, tied: bool, hf_weights: dict[str, np.ndarray] | None = None,
                     chat_template: bool = True, biases: bool | None = None, quant=Q8) -> Path:  # fmt: skip
    """A small llama/qwen2 GGUF with the fixture's tokenizer; `hf_weights` receives the HF-order values."""
    rng = np.random.default_rng(7)
    meta = open_gguf(TINY_GGUF / "model-q8_0.gguf").metadata
    h, heads, kv, ffn, vocab = GEO["hidden"], GEO["heads"], GEO["kv_heads"], GEO["ffn"], GEO["vocab"]
    d = h // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(GEO["layers"])
    w.add_context_length(2048)
    w.add_embedding_length(h)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "llama-bpe")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_eos_token_id(3970)
    w.add_bos_token_id(3969)
    if chat_template:
        w.add_chat_template(meta["tokenizer.chat_template"])
    hf = {} if hf_weights is None else hf_weights

    def add(name: str, shape: tuple[int, ...], qk_heads: int | None = None, kind=quant) -> None:
        values = rng.standard_normal(shape, dtype=np.float32) * 0.1
        hf[name] = values
        stored = values if qk_heads is None or arch != "llama" else llama_cpp_permute(values, qk_heads)
        if kind == F32 or len(shape) == 1:
            w.add_tensor(name, np.ascontiguousarray(stored))
        else:
            w.add_tensor(name, gguf.quants.quantize(stored, kind), raw_dtype=kind)

    add("token_embd.weight", (vocab, h))
    if not tied:
        add("output.weight", (vocab, h))
    add("output_norm.weight", (h,))
    for i in range(GEO["layers"]):
        blk = f"blk.{i}"
        add(f"{blk}.attn_norm.weight", (h,))
        add(f"{blk}.ffn_norm.weight", (h,))
        add(f"{blk}.attn_q.weight", (heads * d, h), qk_heads=heads)
        add(f"{blk}.attn_k.weight", (kv * d, h), qk_heads=kv)
        add(f"{blk}.attn_v.weight", (kv * d, h))
        add(f"{blk}.attn_output.weight", (h, heads * d))
        if arch == "qwen2" if biases is None else biases:
            add(f"{blk}.attn_q.bias", (heads * d,))
            add(f"{blk}.attn_k.bias", (kv * d,))
            add(f"{blk}.attn_v.bias", (kv * d,))
        add(f"{blk}.ffn_gate.weight", (ffn, h))
        add(f"{blk}.ffn_up.weight", (ffn, h))
        add(f"{blk}.ffn_down.weight", (h, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _convert(gguf_path: Path, recipe: str, out: Path, **kw):
    return convert(ConvertRequest(recipe=recipe, out=out, sources={"gguf": gguf_path}, **kw), progress=False)


NAME_MAP = {  # logical suffix -> GGUF tensor suffix
    "input_norm": "attn_norm.weight", "post_attention_norm": "ffn_norm.weight",
    "attention/query": "attn_q.weight", "attention/key": "attn_k.weight", "attention/value": "attn_v.weight",
    "attention/output": "attn_output.weight", "attention/query_bias": "attn_q.bias",
    "attention/key_bias": "attn_k.bias", "attention/value_bias": "attn_v.bias",
    "mlp/gate": "ffn_gate.weight", "mlp/up": "ffn_up.weight", "mlp/down": "ffn_down.weight",
}  # fmt: skip


def gguf_name(logical: str) -> str:
    top = {"text/token_embedding": "token_embd.weight", "text/output_head": "output.weight",
           "text/final_norm": "output_norm.weight"}  # fmt: skip
    if logical in top:
        return top[logical]
    _, _, i, rest = logical.split("/", 3)
    return f"blk.{i}.{NAME_MAP[rest]}"


def test_unpermute_rows_invert_llama_cpp_permutation_and_match_transformers():
    rng = np.random.default_rng(1)
    for heads, d in ((4, 16), (3, 64), (1, 2)):
        w = rng.standard_normal((heads * d, 5)).astype(np.float32)
        stored = llama_cpp_permute(w, heads)
        rows = unpermute_rope_rows(heads, d)
        np.testing.assert_array_equal(stored[rows], w)
        ref = hf_reference("blk.0.attn_k.weight", stored, 99, heads, "llama")
        np.testing.assert_array_equal(stored[rows], ref)
    with pytest.raises(ConversionError, match="odd"):
        unpermute_rope_rows(2, 7)


@pytest.mark.parametrize("arch,recipe,tied", [("llama", "llama_gguf", True), ("qwen2", "qwen2_gguf", False)])
def test_synthetic_dense_gguf_converts_to_hf_parameters(tmp_path, arch, recipe, tied):
    hf: dict[str, np.ndarray] = {}
    src = write_dense_gguf(tmp_path / f"{arch}.gguf", arch, tied, hf)
    _convert(src, recipe, tmp_path / "m.ninfer")
    art = open_artifact(tmp_path / "m.ninfer")
    reader = gguf.GGUFReader(src)
    by_name = {t.name: t for t in reader.tensors}
    names = [n for n in art.names() if n.startswith("text/")]
    assert len(names) == 3 + GEO["layers"] * (9 + (3 if arch == "qwen2" else 0))
    for name in names:
        stored = art.tensor(name)
        t = by_name["token_embd.weight" if (tied and name == "text/output_head") else gguf_name(name)]
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        ref = hf_reference(t.name, values, GEO["heads"], GEO["kv_heads"], arch)
        got = stored.dequantize(torch.float32)
        torch.testing.assert_close(got, ref.reshape(got.shape), rtol=0, atol=0, msg=name)
        if stored.format.startswith("gguf_"):  # carried byte for byte (rows possibly gathered)
            assert stored.format == "gguf_q8_0"
        # and the HF-order original, within Q8_0's error: half a step (block max / 127) plus the fp16
        # rounding of the block scale (relative 2^-11, times |q| <= 127)
        orig = torch.from_numpy(hf[t.name]).reshape(got.shape)
        assert (got - orig).abs().max() <= orig.abs().max() * (0.5 / 127 + 2**-11) + 1e-7, name
    if tied:
        bindings = art.directory["bindings"]
        assert bindings["text/output_head"] == bindings["text/token_embedding"]
    cfg = art.components["text"].config
    assert cfg["architecture"] == arch and cfg["tie_word_embeddings"] is tied
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (64, 2, 96)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert cfg["rope_theta"] == 500000.0 and cfg["rope_parameters"]["rope_type"] == "default"
    assert cfg["vocab_size"] == 4096 and cfg["max_position_embeddings"] == 2048
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5) and cfg["attention_bias"] is (arch == "qwen2")
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (3969, 3970)
    built = tokenizer_resources_from_gguf(src).as_resources()
    for role, data in built.items():
        assert art.resource("text", role) == data, role


def test_metadata_dir_overrides_and_geometry_check(tmp_path):
    src = write_dense_gguf(tmp_path / "l.gguf", "llama", tied=True)
    meta = tmp_path / "meta"
    meta.mkdir()
    (meta / "chat_template.jinja").write_text("{{ messages }}")
    (meta / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "foo": 1}))
    _convert(src, "llama_gguf", tmp_path / "a.ninfer", model_dir=meta)
    art = open_artifact(tmp_path / "a.ninfer")
    assert art.resource("text", "chat_template.jinja") == b"{{ messages }}"
    cfg = art.components["text"].config
    assert cfg["foo"] == 1 and cfg["architecture"] == "llama" and cfg["head_dim"] == 16
    (meta / "config.json").write_text(json.dumps({"hidden_size": 64, "num_key_value_heads": 4}))
    with pytest.raises(ConversionError, match="num_key_value_heads = 4 .* has 2"):
        _convert(src, "llama_gguf", tmp_path / "b.ninfer", model_dir=meta)
    assert not (tmp_path / "b.ninfer").exists()


def test_no_chat_template_warns_and_omits_role(tmp_path):
    src = write_dense_gguf(tmp_path / "l.gguf", "llama", tied=True, chat_template=False)
    result = _convert(src, "llama_gguf", tmp_path / "a.ninfer")
    assert any("chat template" in w for w in result.warnings)
    assert "chat_template.jinja" not in open_artifact(tmp_path / "a.ninfer").components["text"].resources


def test_wrong_architecture_and_components_are_refused(tmp_path, capsys):
    src = write_dense_gguf(tmp_path / "q.gguf", "qwen2", tied=True)
    with pytest.raises(GGUFError, match="'qwen2' GGUF.*use --recipe qwen2_gguf"):
        _convert(src, "llama_gguf", tmp_path / "a.ninfer")
    rc = convert_main(["--recipe", "qwen2_gguf", "--source", f"gguf={TINY_GGUF / 'model-q8_0.gguf'}",
                       "--out", str(tmp_path / "b.ninfer"), "--quiet"])  # fmt: skip
    assert rc == 1 and "use --recipe qwen3_5_gguf" in capsys.readouterr().err
    with pytest.raises(ConversionError, match="only a text component"):
        _convert(src, "qwen2_gguf", tmp_path / "c.ninfer", components=("text", "vision"))
    assert not any(tmp_path.glob("*.ninfer"))


def test_missing_qwen2_bias_is_refused(tmp_path):
    src = write_dense_gguf(tmp_path / "q.gguf", "qwen2", tied=True, biases=False)
    with pytest.raises(ConversionError, match="blk.0.attn_q.bias is missing"):
        _convert(src, "qwen2_gguf", tmp_path / "a.ninfer")
    assert not (tmp_path / "a.ninfer").exists()


# ---- the real small models (slow) ---------------------------------------------------------------

REAL = {
    "smollm2": (smollm2_gguf, "llama_gguf", "llama",
                {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                 "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
                 "tie_word_embeddings": True, "rope_theta": 100000.0, "max_position_embeddings": 8192,
                 "eos_token_id": 2}),
    "qwen2.5-coder": (qwen25_coder_gguf, "qwen2_gguf", "qwen2",
                      {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                       "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 4864,
                       "vocab_size": 151936, "tie_word_embeddings": False, "rope_theta": 1000000.0,
                       "max_position_embeddings": 32768, "eos_token_id": 151645}),
}  # fmt: skip
CHECKED = ["text/final_norm", "text/layers/0/input_norm", "text/layers/0/post_attention_norm",
           "text/layers/0/mlp/down", "text/layers/{last}/mlp/gate",
           "text/layers/{last}/attention/output"]  # fmt: skip
QK = ["text/layers/0/attention/query", "text/layers/0/attention/key", "text/layers/0/attention/value",
      "text/layers/{last}/attention/query", "text/layers/{last}/attention/key"]  # fmt: skip
BIASES = ["text/layers/0/attention/query_bias", "text/layers/0/attention/key_bias",
          "text/layers/{last}/attention/value_bias"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("key", list(REAL))
def test_real_model_converts_without_metadata_dir(tmp_path, capsys, key):
    fetch, recipe, arch, expected = REAL[key]
    src = fetch()
    out = tmp_path / f"{key}.ninfer"
    assert convert_main(["--recipe", recipe, "--source", f"gguf={src}", "--out", str(out), "--quiet"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"wrote {out}" and lines[2] == "1 files"
    art = open_artifact(out)
    cfg = art.components["text"].config
    assert cfg["architecture"] == arch
    assert {k: cfg[k] for k in expected} == expected
    last = cfg["num_hidden_layers"] - 1
    names = [n.format(last=last) for n in CHECKED + QK + (BIASES if arch == "qwen2" else [])]
    reader = gguf.GGUFReader(src)
    by_name = {t.name: t for t in reader.tensors}
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name in names:
        t = by_name[gguf_name(name)]
        stored = art.tensor(name)
        if stored.format.startswith("gguf_"):  # byte for byte, modulo the q/k row gather
            assert stored.format == f"gguf_{t.tensor_type.name.lower()}", name
        ref = hf_reference(t.name, gguf.quants.dequantize(t.data, t.tensor_type), heads, kv, arch)
        got = stored.dequantize(torch.float32)
        torch.testing.assert_close(got, ref.reshape(got.shape), rtol=0, atol=0, msg=name)
    _check_vocab_rows(art, by_name, cfg)
    built = tokenizer_resources_from_gguf(src)  # itself checked against transformers in test_gguf_tokenizer
    assert art.resource("text", "tokenizer.json") == built.tokenizer_json.encode()
    assert b"<|im_start|>" in art.resource("text", "chat_template.jinja")


def _check_vocab_rows(art, by_name, cfg) -> None:
    """Embedding and output head on a sample of rows (whole-vocabulary dequantisation is slow)."""
    rows = np.random.default_rng(0).choice(cfg["vocab_size"], 256, replace=False)
    pairs = (("text/token_embedding", "token_embd.weight"), ("text/output_head", "output.weight"))
    for name, tensor in pairs:
        t = by_name.get(tensor, by_name["token_embd.weight"])  # tied: the head is the embedding
        stored = art.tensor(name)
        raw = torch.from_numpy(np.ascontiguousarray(stored.data[rows]))
        got = dequantize(raw, stored.format, (len(rows), stored.shape[1]))
        ref = torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data)[rows], t.tensor_type))
        torch.testing.assert_close(got, ref, rtol=0, atol=0, msg=name)
