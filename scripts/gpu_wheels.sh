#!/usr/bin/env bash
# Run here (not on the device machine), before a GPU session's first device command: downloads
# into .gpu-wheels/ the wheels of what pagedllm imports and the device image lacks (its Python is
# 3.12 with PyTorch, Triton, transformers, tokenizers, safetensors, numpy, httpx, pytest and
# hypothesis, but no llguidance, FastAPI/uvicorn/pydantic, openai or gguf; nothing can be fetched
# there). Versions are this checkout's venv's, so they are the pins in pyproject.toml.
# Then carry it: device `run` with carry [".gpu-wheels"] and `bash scripts/gpu_session.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
names="llguidance gguf xxhash fastapi starlette uvicorn click pydantic pydantic_core annotated-types typing-inspection
typing_extensions openai distro jiter sniffio"
pins=$(.venv/bin/pip freeze 2>/dev/null | awk -F'==' -v names="$names" '
    BEGIN { n = split(names, list, /[ \n]+/); for (i = 1; i <= n; i++) { key = tolower(list[i]); gsub(/[-_]/, "", key); want[key] = 1 } }
    { key = tolower($1); gsub(/[-_]/, "", key); if (key in want) print $1 "==" $2 }')
platforms=""
for tag in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 any; do
    platforms="$platforms --platform $tag"
done
rm -rf .gpu-wheels
# shellcheck disable=SC2086
.venv/bin/pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --abi cp312 --abi abi3 --abi none \
    $platforms -d .gpu-wheels $pins
ls .gpu-wheels
