#!/usr/bin/env bash
# On the CPU machine, before a GPU lease: what the GPU machine's image lacks, into the git-ignored folders the
# `device` tool carries (`run` with carry [".whl", ".fixtures"], 64 MiB in all; this makes ~56 MiB).
#
#   bash bench/device_prep.sh          # then, on the device: bash bench/pending_ab.sh (or gpu_bench.sh)
#
# .whl/: fla-core (the GDN prefill kernels), gguf, pytest-xdist and execnet, pure-Python wheels for the image's
# Python 3.12 (no package index there); the server's (fastapi, uvicorn, pydantic with its cp312 core,
# prometheus-client, httpx: ~5 MiB). .fixtures/shared/: the tiny fixture's files the GPU-marked tests read
# (the bf16, q8_0, q4_k_m and iq3_s GGUFs, hf/, reference/), found through NINFER_SHARED=$PWD/.fixtures/shared.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${NINFER_SHARED:-../shared}
PY=${PYTHON:-python3}
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 -d .whl fla-core==0.6.0 gguf==0.19.0 pytest-xdist execnet 2>&1 \
  | grep -v "^WARNING: Location" || true
# the server's wheels and their own (the image has none of them; tests/test_serve_gpu.py serves over HTTP)
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl "fastapi>=0.110,<1" \
  "uvicorn>=0.29,<1" "pydantic>=2.6,<3" "prometheus-client>=0.20,<1" "httpx>=0.27,<1" 2>&1 \
  | grep -v "^WARNING: Location" || true
tiny=fixtures/qwen35-tiny
dest=.fixtures/shared/$tiny
mkdir -p "$dest/gguf"
for f in model-bf16.gguf model-q8_0.gguf model-q4_k_m.gguf model-iq3_s.gguf mapping_check.json tensor_types.json; do
  cp -u "$SHARED/$tiny/gguf/$f" "$dest/gguf/"
done
cp -ru "$SHARED/$tiny/hf" "$SHARED/$tiny/reference" "$SHARED/$tiny/README.md" "$dest/"
chmod -R u+w .fixtures
du -sh .whl .fixtures
