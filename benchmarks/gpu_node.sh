#!/usr/bin/env bash
# The whole GPU check on a GPU node that has no network (docs/operations.md, "On a GPU
# node"), from a checkout: installs the Triton server wheel brought along as a file, builds
# this checkout into the node's Python (editable: the tests import the built _native),
# builds the demo repository, then runs `make gpu-check` (the GPU tests, bench_gpu.py,
# bench_gpu_served.py) and `make gpu-criteo` (bench_criteo.py: the generated MLPerf-shaped
# DLRM at scale 0.05, KIND_GPU then KIND_CPU on this node, each beside the native floor;
# ~10 GB of disk under the temp dir). Logs and JSON go to OUT_DIR.
#
#   benchmarks/gpu_node.sh OUT_DIR [WHEEL_DIR]      # WHEEL_DIR: default .whl
#
# GPU_PY (default python3) is the node's Python with CuPy and NVRTC; GPU_SERVED_ARGS,
# GPU_BENCH_ARGS and GPU_CRITEO_ARGS are passed to the three benchmarks; GPU_STEPS (default
# "gpu-check gpu-criteo") names the Makefile's steps to run, in order (gpu-tests, gpu-bench,
# gpu-served, gpu-criteo, gpu-criteo-tf32: the KIND_GPU sweep again with dense_math tf32),
# each run even when one before it failed (make -k).
#
# gpu-criteo runs perf_analyzer, which the node lacks: put beside the server wheel in
# WHEEL_DIR tritonclient's wheel (its bin/perf_analyzer), the CUDA 12 runtime's
# (libcudart.so.12, which perf_analyzer links even without a GPU) and Debian's libb64-0d
# package: each is installed when there. benchmarks/gpu_wheels.sh fetches all four on a
# machine with network, slimmed to ~52 MB so that they travel with the checkout.
# In a wrapper command, stop left-over servers with `pkill -x tritonserver`: `pkill -f`
# also matches the shell whose command line names it.
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
# perf_analyzer for gpu-criteo (above): its wheel, the CUDA 12 runtime and libb64, if brought
for w in "$WHEELS"/tritonclient-*.whl "$WHEELS"/nvidia_cuda_runtime_cu12-*.whl; do
  if [ -f "$w" ]; then "$PY" -m pip install -q --no-index --no-deps "$w"; fi
done
for deb in "$WHEELS"/libb64-0d_*.deb; do
  if [ -f "$deb" ]; then
    b64=$(mktemp -d)
    dpkg-deb -x "$deb" "$b64"
    export LD_LIBRARY_PATH="$b64/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
done
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$PY" -m pip install -q --no-index --no-deps \
  --no-build-isolation -e . 2>&1 | tail -3
[ -f model_repository/dlrm/1/dlrm_dense_0.model ] || "$PY" model_repository/dlrm/train.py > "$OUT/train.log"
"$PY" -m ps_loader demo model_repository > "$OUT/demo.log"
echo "set up in $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
make -k ${GPU_STEPS:-gpu-check gpu-criteo} GPU_PY="$PY" GPU_OUT="$OUT" \
  GPU_SERVED_ARGS="${GPU_SERVED_ARGS:-}" GPU_BENCH_ARGS="${GPU_BENCH_ARGS:-}" \
  GPU_CRITEO_ARGS="${GPU_CRITEO_ARGS:-}"
echo "done in $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
