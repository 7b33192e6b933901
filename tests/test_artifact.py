"""The .ninfer v3 writer and reader: byte layout, views, dedupe, parts, uses, and rejection of bad files."""

from __future__ import annotations

import json
import struct

import gguf
import numpy as np
import pytest
import torch

from ninfer.artifact import ArtifactWriter, open_artifact
from ninfer.errors import ArtifactError


def _dense_writer(path, rows_per_chunk=3, **kw):
    """A qwen2-architecture text component with zero layers: the smallest valid artifact."""
    w = ArtifactWriter(path, rows_per_chunk=rows_per_chunk, **kw)
    emb = torch.randn(10, 8).to(torch.bfloat16)
    norm = torch.randn(8)
    e = w.add_tensor("bf16", emb.shape, lambda b, e_: emb[b:e_], key="emb")
    w.bind("text/token_embedding", e)
    w.bind("text/output_head", w.add_tensor("bf16", emb.shape, lambda b, e_: emb[b:e_], key="emb"))
    w.bind("text/final_norm", w.add_tensor("f32", norm.shape, lambda b, e_: norm[b:e_].numpy()))
    tok = w.add_resource(b'{"model": {}}')
    w.set_component("text", {"architecture": "qwen2", "num_hidden_layers": 0}, {"tokenizer.json": tok})
    w.metadata.update(name="tiny", architecture="qwen2")
    return w, emb, norm


def test_roundtrip_layout_and_views(tmp_path):
    path = tmp_path / "a.ninfer"
    w, emb, norm = _dense_writer(path)
    # a block-format tensor: 4 ggml rows of q8_0 random bytes with finite scales
    q8 = np.random.default_rng(1).integers(0, 256, size=(4, 2 * 34), dtype=np.uint8)
    q8.reshape(4, 2, 34)[:, :, 1] = 0x1C  # fp16 scale exponent well inside range
    qid = w.add_tensor("gguf_q8_0", (4, 64), lambda b, e: q8[b:e])
    w.bind("extra/q8", qid)
    w.bind_parts("extra/q8_rows_1_3", [(qid, 64, 192)])
    cols = torch.randperm(64).to(torch.int32)
    w.add_use("extra/q8", {"input_columns": w.add_tensor("i32", (64,), lambda b, e: cols[b:e])})
    summary = w.write()

    raw = path.read_bytes()
    magic, json_bytes, art_id = struct.unpack("<8sQ16s", raw[:32])
    assert magic == b"NINFER\x00\x03" and art_id.hex() == summary.artifact_id
    directory = json.loads(raw[32 : 32 + json_bytes])
    payload_start = (32 + json_bytes + 4095) // 4096 * 4096
    assert raw[32 + json_bytes : payload_start] == b"\0" * (payload_start - 32 - json_bytes)
    assert directory["files"] == [{"path": None, "payload_bytes": len(raw) - payload_start}]
    for o in directory["objects"]:
        if o["kind"] == "tensor":
            assert o["offset"] % 64 == 0
    # identical tensors (same key) are stored once: embedding and tied head share one object
    assert directory["bindings"]["text/token_embedding"] == directory["bindings"]["text/output_head"]
    assert summary.objects == 5

    art = open_artifact(path)
    t = art.tensor("text/token_embedding")
    assert t.format == "bf16" and t.shape == (10, 8) and torch.equal(t.data, emb)
    assert torch.equal(art.tensor("text/final_norm").dequantize(), norm)
    q = art.tensor("extra/q8")
    assert q.data.dtype == torch.uint8 and tuple(q.data.shape) == (4, 68)
    assert torch.equal(q.data, torch.from_numpy(q8))
    ref = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(q.dequantize(), torch.from_numpy(ref))
    part = art.tensor("extra/q8_rows_1_3")
    assert part.shape == (2, 64) and torch.equal(part.data, torch.from_numpy(q8[1:3]))
    assert torch.equal(art.input_columns("extra/q8"), cols.long())
    assert art.input_columns("text/final_norm") is None
    assert art.resource("text", "tokenizer.json") == b'{"model": {}}'
    assert art.metadata["name"] == "tiny" and art.has("extra/q8") and not art.has("nope")
    # zero-copy: the view's storage is the mapped file, not a fresh allocation
    offset = next(o for o in directory["objects"] if o["id"] == directory["bindings"]["extra/q8"]["object"])
    assert bytes(q.data.flatten()[:8].numpy()) == raw[payload_start + offset["offset"] :][:8]


def test_reader_rejects_input_columns_that_are_not_a_permutation(tmp_path):
    path = tmp_path / "a.ninfer"
    w, _, _ = _dense_writer(path)
    cols = torch.arange(64, dtype=torch.int32)
    cols[5] = 7  # column 5 lost, 7 twice
    w.bind("extra/w", w.add_tensor("f32", (2, 64), lambda b, e: np.ones((e - b, 64), np.float32)))
    w.add_use("extra/w", {"input_columns": w.add_tensor("i32", (64,), lambda b, e: cols[b:e])})
    w.write()
    with pytest.raises(ArtifactError, match="input_columns of extra/w is not a permutation"):
        open_artifact(path)


def test_refuses_existing_output_without_force(tmp_path):
    path = tmp_path / "a.ninfer"
    path.write_bytes(b"keep")
    w, _, _ = _dense_writer(path)
    with pytest.raises(ArtifactError, match="--force"):
        w.write()
    assert path.read_bytes() == b"keep"
    w.force = True
    w.write()
    assert open_artifact(path).has("text/token_embedding")
    assert [p.name for p in tmp_path.iterdir()] == ["a.ninfer"]  # no temp file left behind


def test_producer_error_leaves_no_file(tmp_path):
    path = tmp_path / "a.ninfer"
    w, _, _ = _dense_writer(path)
    w.bind("bad", w.add_tensor("f32", (4,), lambda b, e: np.zeros(1, np.float32)))
    with pytest.raises(ArtifactError, match="producer gave 4 bytes"):
        w.write()
    assert list(tmp_path.iterdir()) == []


@pytest.fixture()
def good_file(tmp_path):
    path = tmp_path / "good.ninfer"
    _dense_writer(path)[0].write()
    return path


def _edit_directory(path, out, edit):
    raw = bytearray(path.read_bytes())
    n = struct.unpack("<Q", raw[8:16])[0]
    d = json.loads(raw[32 : 32 + n])
    edit(d)
    text = json.dumps(d).encode()
    assert len(text) <= 4096 - 32, "keep the edit small enough for the same payload start"
    head = struct.pack("<8sQ16s", b"NINFER\x00\x03", len(text), bytes(16)) + text
    raw[: 32 + n] = b"\0" * (32 + n)
    raw[: len(head)] = head
    out.write_bytes(bytes(raw))
    return out


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["objects"][0].update(bytes=d["objects"][0]["bytes"] + 2), "takes"),
        (lambda d: d["objects"][0].update(offset=1 << 20), "exceed the payload"),
        (lambda d: d["objects"][0].update(offset=2), "aligned"),
        (lambda d: d["objects"][0].update(format="q9_9"), "unknown format"),
        (lambda d: d["bindings"].update(x={"object": "t99999"}), "does not exist"),
        (lambda d: d["bindings"].update(x={"parts": [{"object": "t00000", "range": [0, 999]}]}), "outside"),
        (lambda d: d["bindings"].update(x={"parts": [{"object": "t00000", "range": [0, 3]}]}), "whole rows"),
        (lambda d: d["bindings"].pop("text/final_norm"), "text/final_norm"),
        (lambda d: d["components"].pop("text"), "no text component"),
        (lambda d: d["components"]["text"]["config"].update(architecture="gpt9"), "gpt9"),
        (lambda d: d["files"][0].update(payload_bytes=1), "truncated"),
        (lambda d: d.update(uses=[{"parameter": "nope", "auxiliaries": {}}]), "nope"),
    ],
)
def test_reader_rejects_corrupt_directory(good_file, tmp_path, edit, message):
    bad = _edit_directory(good_file, tmp_path / "bad.ninfer", edit)
    with pytest.raises(ArtifactError, match=message):
        open_artifact(bad)


def test_reader_rejects_truncated_and_foreign_files(good_file, tmp_path):
    raw = good_file.read_bytes()
    for n in (0, 20, 100, len(raw) - 1):
        (tmp_path / "t.ninfer").write_bytes(raw[:n])
        with pytest.raises(ArtifactError, match="truncated"):
            open_artifact(tmp_path / "t.ninfer")
    (tmp_path / "g.ninfer").write_bytes(b"GGUF" + raw[4:])
    with pytest.raises(ArtifactError, match="not a .ninfer v3 file"):
        open_artifact(tmp_path / "g.ninfer")
    (tmp_path / "j.ninfer").write_bytes(raw[:40] + b"\xff{" + raw[42:])
    with pytest.raises(ArtifactError, match="corrupt directory JSON"):
        open_artifact(tmp_path / "j.ninfer")
    with pytest.raises(ArtifactError, match="no such artifact"):
        open_artifact(tmp_path / "missing.ninfer")
