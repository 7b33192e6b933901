"""`ninfer-bench --suite issue5` on CPU at tiny sizes: every phase runs, rows stream as they are measured,
the JSON (stdout and --json PATH) has the documented shape, the memory ratio is device bytes / stored bytes,
and the stored bytes of an artifact equal the GGUF's text tensors counted by gguf-py."""

from __future__ import annotations

import json
from dataclasses import fields

import gguf
import pytest
import torch
from conftest import TINY_GGUF

from ninfer.artifact import open_artifact
from ninfer.cli import bench_suite
from ninfer.cli.bench import artifact_wtype, is_27b
from ninfer.cli.bench import main as bench_main
from ninfer.cli.bench_suite import SuiteReport, SuiteSizes, memory_rows
from ninfer.engine.engine import Engine, EngineConfig
from ninfer.engine.memory import module_bytes, stored_weight_bytes
from ninfer.engine.synthetic import synthetic_model, synthetic_source
from ninfer.errors import EngineConfigError

SMALL = ["--synthetic", "tiny", "--wtype", "q4_k", "--suite", "issue5", "--suite-scale", "0.005", "-n", "4",
         "-r", "1", "--prefill-chunk", "32", "--concurrency", "1,2,8", "--threads", "1"]
ROWS = ["copy bandwidth (r+w)", "weights on device / stored", "KV pool", "GDN state", "pp8",
        "tg4 (context 8)", "1-column decode step", "4-column / 1-column step", "decode C=1 aggregate",
        "decode C=2 aggregate", "decode C=8 aggregate", "C=8 / C=1 aggregate", "pp40", "pp81",
        "tg4 at depth 81", "tg at depth 81 / tg4", "torch peak allocated"]


def test_suite_json_rows_and_stream(tmp_path, capsys):
    path = tmp_path / "suite.json"
    assert bench_main([*SMALL, "-o", "json", "--json", str(path)]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert json.loads(path.read_text()) == report
    assert [r["test"] for r in report["rows"]] == ROWS
    assert all(set(r) == {"test", "value", "unit", "target", "ok", "note"} for r in report["rows"])
    rows = {r["test"]: r for r in report["rows"]}
    assert report["suite"] == "issue5" and report["wtype"] == "q4_k" and report["device"] == "cpu"
    assert report["sizes"]["short_prompt"] == 8 and report["sizes"]["concurrency"] == [1, 2, 8]
    speeds = [r for r in report["rows"] if r["unit"] == "tok/s"]
    assert len(speeds) == 8 and all(r["value"] > 0 for r in speeds)
    # CPU dense mode: q4_k blocks dequantised to fp32, so the weights cost ~6.6x their stored bytes
    ratio = rows["weights on device / stored"]
    assert ratio["value"] == pytest.approx(report["device_weight_bytes"] / report["stored_weight_bytes"])
    stored = synthetic_source("tiny", wtype="q4_k").stored_bytes()
    assert ratio["ok"] is False and report["stored_weight_bytes"] == stored
    agg = rows["C=8 / C=1 aggregate"]["value"]
    assert agg == pytest.approx(rows["decode C=8 aggregate"]["value"] / rows["decode C=1 aggregate"]["value"])
    tg = rows["tg4 (context 8)"]
    assert tg["target"] == ">= 200" and tg["ok"] is None  # judged only on a GPU at full sizes
    assert rows["torch peak allocated"]["value"] is None
    assert report["memory"]["kv_tokens"] >= 8 * 64  # 8 lanes of one page each
    # every row was streamed to stderr (stdout holds the JSON) before the JSON was printed
    assert all(name in err for name in ROWS) and err.index("pp8 ") < err.index("pp40")


def test_a_failed_phase_leaves_the_rows_before_it(tmp_path, capsys, monkeypatch):
    def fail(run):
        raise EngineConfigError("boom in the concurrency phase")

    monkeypatch.setattr(bench_suite, "phase_concurrency", fail)
    path = tmp_path / "partial.json"
    assert bench_main([*SMALL, "--json", str(path)]) == 1
    out, err = capsys.readouterr()
    assert "4-column / 1-column step" in out and "error: boom" in err
    assert [r["test"] for r in json.loads(path.read_text())["rows"]] == ROWS[:8]


def test_gdn_state_fp16_shrinks_the_state_row(tmp_path, capsys, monkeypatch):
    def stop(run, limit):
        raise EngineConfigError("stop after the memory rows")

    monkeypatch.setattr(bench_suite, "phase_short", stop)
    rows = {}
    for flags in ([], ["--gdn-state-fp16"]):
        path = tmp_path / f"state{len(flags)}.json"
        assert bench_main([*SMALL, *flags, "--json", str(path)]) == 1
        rows[len(flags)] = {r["test"]: r for r in json.loads(path.read_text())["rows"]}["GDN state"]
    capsys.readouterr()
    # the recurrent states halve; the conv states stay fp32
    assert rows[0]["value"] / 2 < rows[1]["value"] < rows[0]["value"]
    assert rows[0]["note"].endswith("slots of fp32") and rows[1]["note"].endswith("slots of fp16")


def test_quantized_weights_ratio_row():
    model = synthetic_model("tiny", torch.bfloat16, wtype="iq3_s", quantized_weights=True)
    engine = Engine.from_model(model, EngineConfig(max_context=64, kv_capacity=64, dtype="bfloat16"))
    report = SuiteReport({}, open("/dev/null", "w"))  # noqa: SIM115
    stored = synthetic_source("tiny", wtype="iq3_s").stored_bytes()
    memory_rows(engine, report, stored)
    row = report.rows[0]
    assert row.value == module_bytes(model) / stored and row.value <= 1.03 and row.ok is True


def test_stored_bytes_of_an_artifact_equal_the_gguf_text_tensors(tiny_artifact):
    reader = gguf.GGUFReader(TINY_GGUF / "model-bf16.gguf")
    text = sum(int(t.n_bytes) for t in reader.tensors if not t.name.startswith("blk.4."))  # blk.4: MTP
    art = open_artifact(tiny_artifact)
    assert stored_weight_bytes(art) == text
    assert artifact_wtype(art) == "bf16" and not is_27b(synthetic_model("tiny"))


def test_suite_sizes_and_usage_errors(capsys):
    full = SuiteSizes.scaled(1.0, 128, (1, 2, 4, 8), 2)
    assert (full.short_prompt, full.long_prompt, full.depth, full.n_gen) == (512, 8192, 16384, 128)
    assert full.copy_bytes >= 1e9 and full.context_tokens() >= 16384 + 128 and full.kv_tokens() >= 8 * 640
    for bad in (["--suite-scale", "0"], ["--concurrency", "1,9"], ["--kv-dtype", "bf16,int8"]):
        assert bench_main([*SMALL, *bad]) == 1
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: ")
    # --no-cuda-graphs reaches EngineConfig.cuda_graphs where the engine has it, else a one-line error
    has_graphs = "cuda_graphs" in {f.name for f in fields(EngineConfig)}
    assert bench_main(["--synthetic", "tiny", "-p", "4", "-n", "2", "-r", "1", "--no-cuda-graphs"]) == (
        0 if has_graphs else 1)
