"""`ninfer-perplexity` against the transformers fp32 reference logits of the fixture's prompt 1."""

from __future__ import annotations

import contextlib
import io
import json
import math

import numpy as np
import pytest
import torch

from ninfer.cli.perplexity import main as perplexity_main


@pytest.fixture
def artifact(tiny_artifact):
    return tiny_artifact


def run(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = perplexity_main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_matches_transformers_reference(tiny_dir, artifact, tmp_path):
    prompt = json.loads((tiny_dir / "reference" / "prompts.json").read_text())[0]
    ref = np.load(tiny_dir / "reference" / "reference.npz")
    logits = torch.from_numpy(ref["p1_tf_logits"]).double()
    ids = torch.tensor(prompt["ids"])
    nll = -torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None]).mean().item()
    text = tmp_path / "p1.txt"
    text.write_text(prompt["text"], encoding="utf-8")
    rc, out, _ = run([str(artifact), str(text), "--kv-dtype", "fp32,int8", "--chunk", "7", "-o", "json"])
    assert rc == 0
    rows = {r["kv_dtype"]: r for r in json.loads(out)}
    assert rows["fp32"]["test"] == f"ppl{len(prompt['ids'])}"
    assert rows["fp32"]["perplexity"] == pytest.approx(math.exp(nll), rel=1e-4)
    assert rows["int8"]["perplexity"] == pytest.approx(math.exp(nll), rel=2e-2)


def test_bad_input_is_one_line(artifact, tmp_path):
    rc, _, err = run([str(artifact), str(tmp_path / "missing.txt")])
    assert rc == 1 and "text file not found" in err
    rc, _, err = run([str(artifact), str(artifact), "--kv-dtype", "fp64"])
    assert rc == 1 and "unknown --kv-dtype" in err and "fp64" in err
