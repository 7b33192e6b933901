"""Shared helpers for tests that use the real small models shipped in PyPI packages.

Plain functions (cached per process and on disk), usable from any test module (`tests/` is on sys.path):

    from realmodels import smollm2_gguf, smollm2_artifact
    art_path = smollm2_artifact()      # converted once with llama_gguf, no metadata dir

or as pytest fixtures by declaring `pytest_plugins = ["realmodels"]` in a test module and asking for
`smollm2_gguf_path`, `qwen25_coder_gguf_path`, `smollm2_ninfer`, `qwen25_coder_ninfer`.
Tests using them should be marked `@pytest.mark.slow`. The cache is `$NINFER_CACHE` (or
`~/.cache/ninfer/models`); converted artifacts sit in its `artifacts/` folder, keyed by a hash of the
converter's source so a changed converter re-converts.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from ninfer import models_cache


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (llama arch, tied embeddings), fetched once into the cache."""
    return models_cache.smollm2_gguf()


def qwen25_coder_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2 arch, untied Q8_0 output head)."""
    return models_cache.qwen25_coder_gguf()


@functools.cache
def converted(model_key: str) -> Path:
    """The `.ninfer` of a packaged model converted with its dense recipe and no metadata dir (cached)."""
    return models_cache.converted_artifact(models_cache.MODELS[model_key], quiet=True)


def smollm2_artifact() -> Path:
    return converted("smollm2")


def qwen25_coder_artifact() -> Path:
    return converted("qwen2.5-coder")


@functools.cache
def hf_gguf_tokenizer(gguf: Path):
    """transformers' tokenizer built by its GGUF loader (the reference our tokenizer must match)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="session")
def qwen25_coder_gguf_path() -> Path:
    return qwen25_coder_gguf()


@pytest.fixture(scope="session")
def smollm2_ninfer() -> Path:
    return smollm2_artifact()


@pytest.fixture(scope="session")
def qwen25_coder_ninfer() -> Path:
    return qwen25_coder_artifact()
