"""Shared test fixtures: paths to ../shared fixtures and session-cached conversions."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("NINFER_SHARED", REPO.parent / "shared")).resolve()
TINY = SHARED / "fixtures" / "qwen35-tiny"
TINY_GGUF = TINY / "gguf"
TINY_HF = TINY / "hf"
TINY_REF = TINY / "reference"


def _triton_installed() -> bool:
    from ninfer.kernels.triton_support import HAVE_TRITON

    return HAVE_TRITON


# kernel tests through Triton's interpreter: skipped only where Triton is not installed (it is a dependency on
# Linux x86-64 and Windows; other platforms run the PyTorch fallbacks)
needs_triton = pytest.mark.skipif(not _triton_installed(), reason="Triton is a dependency on Linux x86-64")


@pytest.fixture
def triton_on_cpu_env(monkeypatch):
    """Triton kernels take CPU tensors (interpreter) in this test."""
    monkeypatch.setenv("NINFER_TRITON_ON_CPU", "1")


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    """Each test draws from its own seed (its id, salted by NINFER_TEST_SEED): random inputs are the same run
    after run whatever ran before, and `NINFER_TEST_SEED=n` re-rolls every test's inputs at once."""
    import zlib

    import torch

    salt = os.environ.get("NINFER_TEST_SEED", "")
    torch.manual_seed(zlib.crc32(f"{request.node.nodeid}{salt}".encode()))


def word_bytes(x, signed: bool):
    """The 4 bytes of uint32 words (numpy), lowest first, as int64 `[..., 4]`, signed or not."""
    import numpy as np

    x = x.astype(np.int64) & 0xFFFFFFFF
    out = np.stack([(x >> (8 * i)) & 0xFF for i in range(4)], axis=-1)
    return (out ^ 0x80) - 0x80 if signed else out


def ptx_mma_m16n8k32(a, b, a_signed: bool):
    """PTX mma.m16n8k32 (s8 or u8 A, s8 B) in numpy by its fragment tables: a `[..., 32 lanes, 4 words]`, b
    `[32 lanes, 2 words]` -> d `[..., 32 lanes, 4]` int64. Lane 4g + t: a word i = row g + 8(i & 1), k 4t +
    16(i >> 1) + byte; b word i = k 4t + 16i + byte, column g; d i = row g + 8(i >> 1), column
    2t + (i & 1)."""
    import numpy as np

    lanes = np.arange(32)
    g, t = lanes >> 2, lanes & 3
    dense_a = np.zeros(a.shape[:-2] + (16, 32), dtype=np.int64)
    dense_b = np.zeros((32, 8), dtype=np.int64)
    for i in range(4):
        a_bytes = word_bytes(a[..., i], a_signed)
        for byte in range(4):
            dense_a[..., g + 8 * (i & 1), 4 * t + 16 * (i >> 1) + byte] = a_bytes[..., byte]
    for i in range(2):
        for byte in range(4):
            dense_b[4 * t + 16 * i + byte, g] = word_bytes(b[:, i], True)[:, byte]
    dense_d = dense_a @ dense_b
    return np.stack([dense_d[..., g + 8 * (i >> 1), 2 * t + (i & 1)] for i in range(4)], axis=-1)

def gemv_case(fmt: str, rows: int, cols: int, width: int, seed: int):
    """Random valid GGUF rows of `fmt` and an activation `[width, cols]` with per-row spread, seeded."""
    import torch

    from ninfer.kernels.gguf_matmul import random_gguf_weight

    g = torch.Generator().manual_seed(seed)
    raw = random_gguf_weight(fmt, rows, cols, generator=g)
    x = torch.randn(width, cols, generator=g) * (0.5 + torch.rand(width, 1, generator=g))
    return raw, x


def kernels_only(monkeypatch, module, *references: str):
    """Run the Triton kernels themselves (interpreter) on CPU tensors; where Triton is installed, each named
    PyTorch fallback of `module` fails the test if it runs instead. Returns the first fallback (an oracle)."""
    from ninfer.kernels.triton_support import HAVE_TRITON

    def no_fallback(*args, **kwargs):
        raise AssertionError("the PyTorch fallback ran instead of the Triton kernel")

    monkeypatch.setenv("NINFER_TRITON_ON_CPU", "1")
    originals = [getattr(module, name) for name in references]
    if HAVE_TRITON:
        for name in references:
            monkeypatch.setattr(module, name, no_fallback)
    return originals[0] if originals else None


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # torch missing or broken: GPU tests cannot run
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    assert TINY.is_dir(), f"fixtures not found at {TINY}; set NINFER_SHARED"
    return TINY


def convert_tiny(out: Path, gguf_name: str = "model-bf16.gguf") -> Path:
    """One of the tiny fixture's GGUFs converted with ninfer-convert (text only) into `out`."""
    import contextlib
    import io

    from ninfer.cli.convert import main as convert

    argv = ["--model", str(TINY_HF), "--recipe", "qwen3_5_gguf", "--source",
            f"gguf={TINY_GGUF / gguf_name}", "--name", "qwen35-tiny", "--out", str(out)]
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        assert convert(argv) == 0
    return out


def reference_prompts() -> dict[str, tuple[int, ...]]:
    """The fixture's three reference prompts (token ids), by name: p1, p2, p3."""
    import numpy as np

    ref = np.load(TINY_REF / "reference.npz")
    return {p: tuple(ref[f"{p}_ids"].tolist()) for p in ("p1", "p2", "p3")}


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory) -> Path:
    """The converted tiny bf16 artifact, shared by every test of the session (treat it as read-only)."""
    return convert_tiny(tmp_path_factory.mktemp("tiny") / "tiny.ninfer")


def lane_conv_on_and_off(monkeypatch, matmul, words, x, n: int, conv):
    """An il32 / q4il matmul of a row a lane with `conv` (a `gdn_decode.ConvEpilogue`) under
    NINFER_LANE_CONV=0 (the conv left to the caller) and as set (run in the GEMV's epilogue): the output, the
    same bits both ways."""
    import torch

    monkeypatch.setenv("NINFER_LANE_CONV", "0")
    plain = matmul(words, x, n, conv=conv)
    assert not conv.applied
    monkeypatch.delenv("NINFER_LANE_CONV")
    y = matmul(words, x, n, conv=conv)
    assert conv.applied and torch.equal(y, plain)
    return y


def assert_conv_ran(y, conv, before, atol: float = 1e-6) -> None:
    """Each lane's GDN decode conv of the first C outputs as stored (bf16 `y`, a row a position of a lane,
    `conv.positions` a lane), `gdn_decode.conv_epilogue_store`'s arithmetic position after position: silu
    of the weights against the lane's last three inputs (`before`: the slots before) and its new one, the
    slot moved on by the lane's inputs; the other slots untouched."""
    import torch

    c, ids, T = conv.channels, conv.slot_ids.tolist(), conv.positions
    for lane, slot in enumerate(ids):
        last = before[slot]
        for m in range(lane * T, lane * T + T):
            window = torch.cat([last, y[m, :c].float()[:, None]], dim=1)  # [C, 4], oldest input first
            acc = (conv.weight * window).sum(1)
            torch.testing.assert_close(conv.out[m], acc * torch.sigmoid(acc), rtol=1e-5, atol=atol)
            last = window[:, 1:]
        assert torch.equal(conv.slots[slot], last), lane
    idle = [i for i in range(before.shape[0]) if i not in ids]
    assert torch.equal(conv.slots[idle], before[idle])
