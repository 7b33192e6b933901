"""`ninfer` and `ninfer-bench` end to end on the converted tiny fixture (greedy ids against transformers)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ninfer.cli.bench import main as bench_main
from ninfer.cli.run import main as run_main


@pytest.fixture(scope="module")
def ref(tiny_dir):
    return dict(np.load(tiny_dir / "reference" / "reference.npz"))


def token_ids(stderr: str) -> list[int]:
    line = next(x for x in stderr.splitlines() if x.startswith("token ids:"))
    return [int(t) for t in line.split(":")[1].split()]


def stable_prefix(ref, p: str) -> int:
    margin = ref[f"{p}_tf_greedy_margin"]
    return next((i for i, m in enumerate(margin) if m < 1e-2), len(margin)) + 1


def test_raw_prompt_greedy_equals_transformers(tiny_artifact, ref, tiny_dir, capsys):
    prompts = json.loads((tiny_dir / "reference" / "prompts.json").read_text())
    text = prompts[1]["text"]  # p2, code
    rc = run_main([str(tiny_artifact), "--raw", "--prompt", text, "--greedy", "--max-new", "24",
                   "--ignore-eos", "--kv-dtype", "fp32", "--print-token-ids"])
    out = capsys.readouterr()
    assert rc == 0
    n = stable_prefix(ref, "p2")
    assert token_ids(out.err)[:n] == ref["p2_tf_greedy"].tolist()[:n]
    assert "prompt 22 tokens" in out.err and "decode" in out.err and "TTFT" in out.err
    assert out.out.strip()  # the answer (gibberish, but text) on stdout


def test_chat_prompt_goes_through_the_template(tiny_artifact, ref, capsys):
    # p1 is the chat-templated "Name a color of the sea." with the thinking generation prompt
    rc = run_main([str(tiny_artifact), "--prompt", "Name a color of the sea.", "--greedy", "--max-new", "8",
                   "--ignore-eos", "--kv-dtype", "fp32", "--print-token-ids"])
    out = capsys.readouterr()
    assert rc == 0
    assert "prompt 20 tokens" in out.err
    assert token_ids(out.err) == ref["p1_tf_greedy"].tolist()[:8]


def test_messages_file_and_seeded_sampling_reproducible(tiny_artifact, tmp_path, capsys):
    msgs = tmp_path / "m.json"
    msgs.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    argv = [str(tiny_artifact), "--messages", str(msgs), "--seed", "3", "--max-new", "6", "--no-thinking",
            "--print-token-ids", "--kv-dtype", "int8"]
    assert run_main(argv) == 0
    first = token_ids(capsys.readouterr().err)
    assert run_main(argv) == 0
    assert token_ids(capsys.readouterr().err) == first and len(first) <= 6


def test_user_errors_are_one_line(tiny_artifact, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    assert run_main([str(tiny_artifact), "--messages", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not valid JSON" in err and "Traceback" not in err
    assert run_main([str(tmp_path / "missing.ninfer"), "--prompt", "x"]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the "loading ..." progress line
    assert last.startswith("error: ") and "missing.ninfer" in last
    assert run_main([str(tiny_artifact), "--prompt", "x", "--max-new", "50", "--max-context", "10"]) == 1
    assert "context" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        run_main([str(tiny_artifact)])  # neither --prompt nor --messages
    assert exc.value.code == 2


def test_bench_json_on_the_artifact_and_synthetic(tiny_artifact, capsys):
    assert bench_main([str(tiny_artifact), "-p", "64", "-n", "8", "-r", "2", "--kv-dtype", "rk8v4",
                       "-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["test"] for r in rows} == {"pp64", "tg8"}
    assert all(r["tok_per_s"] > 0 and len(r["samples"]) == 2 and r["kv_dtype"] == "rk8v4" for r in rows)
    assert bench_main(["--synthetic", "tiny", "-p", "32", "-n", "4", "-r", "1"]) == 0
    table = capsys.readouterr().out
    assert "pp32" in table and "tg4" in table and "synthetic-tiny" in table


def test_bench_perplexity_per_kv_dtype(tiny_artifact, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("The sea is blue and the sky is grey. " * 20)
    assert bench_main([str(tiny_artifact), "--perplexity", str(text), "--ppl-tokens", "100",
                       "--kv-dtype", "fp32,rk8v4", "-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["kv_dtype"] for r in rows] == ["fp32", "rk8v4"]
    # random weights: perplexity near the vocabulary size, and the KV dtype moves it only slightly
    assert 100 < rows[0]["perplexity"] < 40_000
    assert abs(rows[1]["perplexity"] / rows[0]["perplexity"] - 1) < 0.05
    assert bench_main([str(tiny_artifact), "--kv-dtype", "q3"]) == 1

