#!/usr/bin/env bash
# What a session lent a GPU runs first (issue 32's "whenever a GPU is available"), as one command
# of under ten minutes on the device machine, from the repository root:
#
#   bash scripts/gpu_session.sh        (logs under $OUT, else /tmp/gpu-session)
#
# with the wheels of what the device image lacks carried along: run `bash scripts/gpu_wheels.sh`
# here first, and give the device call carry [".gpu-wheels"]; they are installed before anything.
#
# 1. the CUDA suite (`pytest -m cuda`) over the test files that hold CUDA tests (the others import
#    what the device machine may not have: Ray, Playwright);
# 2. `pagedllm bench offline --device cuda --shape llama-1b` against transformers' generate_batch
#    (the issue's baseline), then the same workload without the baseline for device bursts
#    (num_scheduler_steps=8), async scheduling, and both: each prints output tok/s, the GPU's busy
#    share of steady decode engine steps (target >= 85 %) and single-stream tok/s.
# Each part has its own time limit, so one that hangs still leaves the others' logs.
set -u
out=${OUT:-/tmp/gpu-session}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python=$(command -v python3 || command -v python)  # the device image's Python with PyTorch is python3
if [ -d .gpu-wheels ]; then
    "$python" -m pip install --quiet --no-index --no-deps .gpu-wheels/*.whl >"$out/wheels.txt" 2>&1
    echo "carried wheels installed: rc $?"
fi
"$python" - <<'PY' 2>&1 | tee "$out/env.txt"
import torch, triton, transformers
print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__,
      "transformers", transformers.__version__)
PY
cuda_files=$(grep -rl "mark.cuda" tests | sort)
timeout 220 "$python" -m pytest -m cuda -q -p no:cacheprovider $cuda_files >"$out/cuda-tests.txt" 2>&1
echo "pytest -m cuda: rc $? ($(tail -1 "$out/cuda-tests.txt"))"
bench="$python -m pagedllm.cli bench offline --device cuda --shape llama-1b --model-cache /tmp/pagedllm-llama-1b"
timeout 150 $bench >"$out/bench-baseline.txt" 2>&1
echo "bench, default engine, against transformers: rc $?"
for variant in "num_scheduler_steps=8" "async_scheduling=true" "async_scheduling=true,num_scheduler_steps=8"; do
    args=$(echo "$variant" | tr ',' '\n' | sed 's/^/--engine-arg /' | tr '\n' ' ')
    timeout 70 $bench --skip-transformers $args >"$out/bench-${variant//[=,]/-}.txt" 2>&1
    echo "bench, $variant: rc $?"
done
grep -hE "tok/s|GPU busy|speed-up|async scheduling" "$out"/bench-*.txt
