#!/usr/bin/env bash
# The whole GPU check on a GPU node that has no network (docs/operations.md, "On a GPU
# node"), from a checkout: installs the Triton server wheel brought along as a file, builds
# this checkout into the node's Python (editable: the tests import the built _native),
# builds the demo repository, then runs `make gpu-check` (the GPU tests, bench_gpu.py,
# bench_gpu_served.py). Logs and JSON go to OUT_DIR.
#
#   benchmarks/gpu_node.sh OUT_DIR [WHEEL_DIR]      # WHEEL_DIR: default .whl
#
# GPU_PY (default python3) is the node's Python with CuPy and NVRTC; GPU_SERVED_ARGS and
# GPU_BENCH_ARGS are passed to the two benchmarks; GPU_STEPS (default gpu-check) names the
# Makefile's steps to run, in order (gpu-tests, gpu-bench, gpu-served), each run even when
# one before it failed (make -k).
set -euo pipefail
OUT=${1:?usage: benchmarks/gpu_node.sh OUT_DIR [WHEEL_DIR]}
WHEELS=${2:-.whl}
PY=${GPU_PY:-python3}
mkdir -p "$OUT"
start=$(date +%s)
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "$PY" -c 'import sys, numpy, cupy; print(sys.version.split()[0], "numpy", numpy.__version__, "cupy", cupy.__version__)'
  nproc
} 2>&1 | tee "$OUT/env.txt"
"$PY" -m pip install -q --no-index --no-deps "$WHEELS"/nvidia_pytriton-*.whl
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$PY" -m pip install -q --no-index --no-deps \
  --no-build-isolation -e . 2>&1 | tail -3
[ -f model_repository/dlrm/1/dlrm_dense_0.model ] || "$PY" model_repository/dlrm/train.py > "$OUT/train.log"
"$PY" -m ps_loader demo model_repository > "$OUT/demo.log"
echo "set up in $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
make -k ${GPU_STEPS:-gpu-check} GPU_PY="$PY" GPU_OUT="$OUT" GPU_SERVED_ARGS="${GPU_SERVED_ARGS:-}" \
  GPU_BENCH_ARGS="${GPU_BENCH_ARGS:-}"
echo "done in $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
