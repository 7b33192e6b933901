"""ninfer-convert / ninfer-inspect user mistakes: one `error:` line naming the problem and fix, exit 1.

Also: a conversion killed with SIGKILL while writing leaves nothing at --out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, SHARED, TINY_GGUF, TINY_HF

from ninfer.cli.convert import main as convert_main
from ninfer.cli.inspect import main as inspect_main

GGUF = TINY_GGUF / "model-q8_0.gguf"
MMPROJ = TINY_GGUF / "mmproj-bf16.gguf"
META_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
)


@pytest.fixture()
def meta(tmp_path) -> Path:
    """A metadata folder like --model expects (no weights)."""
    d = tmp_path / "meta"
    d.mkdir()
    for name in META_FILES:
        shutil.copy(TINY_HF / name, d / name)
    return d


def run(capsys, *args: str, tool=convert_main) -> tuple[int, str, str]:
    argv = [*args, "--quiet"] if tool is convert_main else list(args)
    rc = tool(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return rc, captured.out, captured.err


def error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def gguf_args(meta: Path, out: Path, *extra: str, gguf: Path = GGUF) -> list[str]:
    return ["--recipe", "qwen3_5_gguf", "--source", f"gguf={gguf}", "--model", str(meta), "--out", str(out),
            *extra]  # fmt: skip


def test_missing_generation_config_names_file_place_and_flag(capsys, meta, tmp_path):
    (meta / "generation_config.json").unlink()
    rc, _, err = run(capsys, *gguf_args(meta, tmp_path / "o.ninfer"))
    line = error_line(err)
    assert rc == 1
    assert "generation_config.json not found" in line and str(meta) in line
    assert "--resource generation_config.json=PATH" in line
    assert not (tmp_path / "o.ninfer").exists()
    # and the suggested fix works
    rc, out, _ = run(
        capsys,
        *gguf_args(
            meta,
            tmp_path / "o.ninfer",
            "--resource",
            f"generation_config.json={TINY_HF / 'generation_config.json'}",
        ),
    )
    assert rc == 0 and "wrote" in out


@pytest.mark.parametrize("missing", ["preprocessor_config.json", "video_preprocessor_config.json"])
def test_vision_without_preprocessor_configs(capsys, meta, tmp_path, missing):
    (meta / missing).unlink()
    rc, _, err = run(
        capsys,
        *gguf_args(
            meta, tmp_path / "o.ninfer", "--source", f"vision={MMPROJ}", "--components", "text,vision"
        ),
    )
    line = error_line(err)
    assert rc == 1 and f"vision needs {missing}" in line and f"--resource {missing}=PATH" in line


def test_vision_without_vision_source(capsys, meta, tmp_path):
    rc, _, err = run(capsys, *gguf_args(meta, tmp_path / "o.ninfer", "--components", "text,vision"))
    assert rc == 1 and "--source vision=PATH" in error_line(err)


def test_mtp_requested_without_mtp_source(capsys, meta, tmp_path):
    rc, _, err = run(capsys, *gguf_args(meta, tmp_path / "o.ninfer", "--components", "text,mtp"))
    line = error_line(err)
    assert rc == 1 and "no --source mtp=PATH" in line and "drop mtp from --components" in line


@pytest.fixture(scope="module")
def synth_no_mtp(tmp_path_factory) -> Path:
    """A synthetic qwen35 GGUF without the MTP layer (shared tool, tiny preset)."""
    out = tmp_path_factory.mktemp("synth") / "no-mtp.gguf"
    subprocess.run(
        [
            sys.executable,
            str(SHARED / "tools" / "synth_qwen35_gguf.py"),
            "--preset",
            "tiny",
            "--wtype",
            "q8_0",
            "--no-mtp",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    return out


def test_mtp_source_without_nextn_tensors(capsys, synth_no_mtp, tmp_path):
    resources = [
        a
        for n in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")
        for a in ("--resource", f"{n}={TINY_HF / n}")
    ]
    rc, _, err = run(capsys, "--recipe", "qwen3_5_gguf", "--source", f"gguf={synth_no_mtp}",
                     "--source", f"mtp={synth_no_mtp}", "--components", "text,mtp", *resources,
                     "--out", str(tmp_path / "o.ninfer"))  # fmt: skip
    line = error_line(err)
    assert rc == 1 and "has no blk.8.nextn.* tensors" in line and "-mtp GGUF" in line
    # without a config.json the text config comes from the header (a warning says so), and the file converts
    rc, out, err = run(capsys, "--recipe", "qwen3_5_gguf", "--source", f"gguf={synth_no_mtp}", *resources,
                       "--out", str(tmp_path / "o.ninfer"))  # fmt: skip
    assert rc == 0 and "derived from the GGUF header" in err and "wrote" in out


def test_mtp_source_without_mtp_component_warns(capsys, meta, tmp_path):
    rc, out, err = run(capsys, *gguf_args(meta, tmp_path / "o.ninfer", "--source", f"mtp={GGUF}"))
    assert rc == 0 and "wrote" in out
    assert "warning: " in err and "the MTP layer will not be included; add mtp to --components" in err
    from ninfer.artifact import open_artifact

    assert "mtp" not in open_artifact(tmp_path / "o.ninfer").components


def test_vision_source_without_vision_component_warns(capsys, meta, tmp_path):
    rc, out, err = run(capsys, *gguf_args(meta, tmp_path / "o.ninfer", "--source", f"vision={MMPROJ}"))
    assert rc == 0 and "the vision tower will not be included; add vision to --components" in err


def test_geometry_mismatch_names_key_found_expected(capsys, meta, tmp_path):
    cfg = json.loads((meta / "config.json").read_text())
    cfg["text_config"]["hidden_size"] = 512
    (meta / "config.json").write_text(json.dumps(cfg))
    rc, _, err = run(capsys, *gguf_args(meta, tmp_path / "o.ninfer"))
    line = error_line(err)
    assert rc == 1 and "geometry mismatch" in line and "hidden_size = 512" in line and "has 256" in line


def test_27b_recipe_guards_geometry(capsys, meta, tmp_path):
    rc, _, err = run(capsys, "--recipe", "qwen3_8_27b_gguf", "--source", f"gguf={GGUF}", "--model", str(meta),
                     "--out", str(tmp_path / "o.ninfer"))  # fmt: skip
    line = error_line(err)
    assert rc == 1 and "needs the 27B geometry: hidden_size is 256, expected 5120" in line


def test_unknown_recipe_lists_recipes(capsys, meta, tmp_path):
    rc, _, err = run(capsys, "--recipe", "qwen9", "--source", f"gguf={GGUF}", "--out", str(tmp_path / "o"))
    line = error_line(err)
    assert rc == 1 and "unknown recipe 'qwen9'" in line
    for name in ("qwen3_5", "qwen3_5_gguf", "qwen3_6_27b_gguf", "qwen3_8_27b_gguf"):
        assert name in line


def test_wrong_gguf_architecture(capsys, meta, tmp_path):
    rc, _, err = run(capsys, *gguf_args(meta, tmp_path / "o.ninfer", gguf=MMPROJ))
    line = error_line(err)
    assert rc == 1 and "'clip' GGUF" in line and "qwen35" in line


def _truncated(tmp_path: Path, source: Path, n: int, name: str) -> Path:
    out = tmp_path / name
    with open(source, "rb") as f:
        out.write_bytes(f.read(n))
    return out


def test_truncated_and_corrupt_gguf(capsys, meta, tmp_path):
    size = GGUF.stat().st_size
    cases = {
        _truncated(tmp_path, GGUF, size - 1000, "data.gguf"): "truncated: tensor",
        _truncated(tmp_path, GGUF, 5000, "head.gguf"): "truncated GGUF header",
    }
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGUX" + GGUF.read_bytes()[4:100])
    cases[bad] = "not a GGUF file"
    for path, message in cases.items():
        rc, _, err = run(capsys, *gguf_args(meta, tmp_path / "o.ninfer", gguf=path))
        line = error_line(err)
        assert rc == 1 and message in line and str(path) in line


def test_truncated_and_corrupt_safetensors(capsys, meta, tmp_path):
    st = TINY_HF / "model.safetensors"
    short = _truncated(tmp_path, st, st.stat().st_size - 10, "short.safetensors")
    head = _truncated(tmp_path, st, 100, "head.safetensors")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes((50).to_bytes(8, "little") + b"{not json" + b" " * 41 + b"\0" * 64)
    for path, message in ((short, "truncated or corrupt"), (head, "truncated safetensors header"),
                          (garbage, "corrupt safetensors header")):  # fmt: skip
        args = ["--recipe", "qwen3_5", "--source", f"safetensors={path}", "--model", str(meta)]
        rc, _, err = run(capsys, *args, "--out", str(tmp_path / "o.ninfer"))
        line = error_line(err)
        assert rc == 1 and message in line, line


def test_truncated_artifact_is_rejected_by_inspect(capsys, meta, tmp_path):
    out = tmp_path / "o.ninfer"
    assert run(capsys, *gguf_args(meta, out))[0] == 0
    cut = _truncated(tmp_path, out, out.stat().st_size - 100, "cut.ninfer")
    rc, _, err = run(capsys, str(cut), tool=inspect_main)
    line = error_line(err)
    assert rc == 1 and "truncated" in line and str(cut) in line


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--source", "gguf=/nonexistent/x.gguf"], "--source gguf=/nonexistent/x.gguf: no such file"),
        (["--components", "text,audio"], "unknown component 'audio' in --components"),
        (["--resource", "vocab.txt=/etc/hostname"], "unknown resource role 'vocab.txt'"),
        (["--resource", "chat_template.jinja=/nonexistent.jinja"], "no such file"),
        (["--source", "weights=/etc/hostname"], "unknown source name 'weights'"),
        (["--source", "safetensors=/etc/hostname"], "does not read --source safetensors="),
        (["--model", "/nonexistent-dir"], "--model /nonexistent-dir: no such folder"),
        (["--rows-per-chunk", "0"], "--rows-per-chunk must be at least 1"),
    ],
)
def test_bad_flags(capsys, meta, tmp_path, extra, message):
    args = ["--recipe", "qwen3_5_gguf", "--model", str(meta), "--out", str(tmp_path / "o.ninfer")]
    if not any(a.startswith("gguf=") for a in extra):
        args += ["--source", f"gguf={GGUF}"]
    rc, _, err = run(capsys, *args, *extra)
    assert rc == 1 and message in error_line(err)


def test_existing_output_needs_force(capsys, meta, tmp_path):
    out = tmp_path / "o.ninfer"
    out.write_bytes(b"precious")
    rc, _, err = run(capsys, *gguf_args(meta, out))
    assert rc == 1 and "already exists; pass --force" in error_line(err)
    assert out.read_bytes() == b"precious"
    rc, out_text, _ = run(capsys, *gguf_args(meta, out, "--force"))
    assert rc == 0 and out.read_bytes()[:8] == b"NINFER\x00\x03"


def test_malformed_source_flag_is_a_usage_error(capsys, meta, tmp_path):
    with pytest.raises(SystemExit) as exc:
        convert_main(["--recipe", "qwen3_5_gguf", "--source", "ggufPATH", "--out", str(tmp_path / "o")])
    assert exc.value.code == 2 and "expects NAME=PATH" in capsys.readouterr().err


_SLOW_CONVERT = """
import sys, time
from ninfer.artifact import writer
write_tensor = writer.ArtifactWriter._write_tensor
def slow(self, f, obj):
    n = write_tensor(self, f, obj)
    f.flush()
    time.sleep(0.5)
    return n
writer.ArtifactWriter._write_tensor = slow
from ninfer.cli.convert import main
sys.exit(main(sys.argv[1:]))
"""


def _payload_started(temp: Path) -> bool:
    """The temp file holds the header, the directory and at least one payload byte."""
    if not temp.exists() or temp.stat().st_size < 16:
        return False
    with open(temp, "rb") as f:
        json_bytes = int.from_bytes(f.read(16)[8:16], "little")
    payload_start = (32 + json_bytes + 4095) // 4096 * 4096
    return 0 < json_bytes and temp.stat().st_size > payload_start


def test_sigkill_midway_leaves_no_output(meta, tmp_path):
    out = tmp_path / "killed.ninfer"
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_CONVERT, *gguf_args(meta, out), "--quiet"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    temp = tmp_path / f".killed.ninfer.tmp-{proc.pid}"
    deadline = time.monotonic() + 120
    while not _payload_started(temp):
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "conversion never started writing"
        time.sleep(0.05)
    proc.kill()  # SIGKILL on POSIX: no cleanup handlers run
    proc.wait()
    assert proc.returncode == -9 if os.name == "posix" else proc.returncode != 0
    assert not out.exists()
    assert not out.with_name(out.name + ".conversion.json").exists()
