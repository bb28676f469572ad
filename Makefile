# Two commands do everything on a fresh machine:
#   make serve   venv + install (builds the C++ extension) + Triton wheel + demo models + server on 8000/8001/8002
#   make test    the whole suite, end-to-end tests against a real tritonserver included
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The project's extras installed into the venv, resolved together; on a GPU node add gpu
# (CUDA 12) or gpu-cuda13 (docs/operations.md, "On a GPU node"):
#   make serve EXTRAS=server,test,tiers,lint,gpu
EXTRAS ?= server,test,tiers,lint
comma  := ,
STAMP  := $(VENV)/.installed-$(subst $(comma),+,$(EXTRAS))
NATIVE := $(wildcard src/native/*.cpp src/native/*.hpp src/native/kernels/*.cu src/triton_backend/*.cpp src/triton_backend/*.h src/triton_backend/*.hpp src/triton_backend/trec/*.cpp src/triton_backend/trec/*.hpp)
# C++ that clang-format checks: the package's, the benchmarks' (built by the benchmarks) and
# the tests' (tests/native, built by tests/unit/test_gpu_host_paths.py)
CXX_SOURCES := $(NATIVE) $(wildcard benchmarks/*.cpp tests/native/*.cpp)
# libpython3.X.so.1.0 of the Python in use (the venv's, else $(PYTHON)): the Triton Python stub
# and the native backend link it. An interpreter built with --enable-shared (pyenv, uv, conda,
# a CUDA image's venv) brings its own, which the launcher puts first on the stub's library
# path (triton_rec.triton.runtime.python_library_dir); one that has none needs the Debian/Ubuntu
# package named after its version (libpython3.11 for Debian 12's python3, libpython3.12, ...).
PY_IN_USE := $(if $(wildcard $(PY)),$(PY),$(PYTHON))
LIBPYTHON_PACKAGE := $(shell $(PY_IN_USE) -c 'import os, sys, sysconfig as c; \
  d, so = c.get_config_var("LIBDIR") or "", c.get_config_var("INSTSONAME") or ""; \
  own = ".so" in so and os.path.exists(os.path.join(d, so)); \
  print("" if own else "libpython%d.%d" % sys.version_info[:2])' 2>/dev/null)
# Debian packages: $(LIBPYTHON_PACKAGE) (above; none when the interpreter has its own),
# libb64-0d (perf_analyzer), redis-server + openssl (the Redis Cluster tier and its tests),
# libjemalloc2 (the server's allocator: TRITON_REC_MALLOC in triton_rec/triton/runtime.py).
APT_PACKAGES ?= $(LIBPYTHON_PACKAGE) libb64-0d redis-server openssl libjemalloc2

.PHONY: all install system-deps triton demo serve lint test unit e2e bench bench-criteo \
	bench-dense bench-dense-math perf clean \
	gpu-check gpu-tests gpu-bench gpu-served gpu-criteo gpu-criteo-tf32

all: install

system-deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

# The build's tools in the venv (pyproject.toml's build-system requires, cmake, ninja), and
# the install built without isolation: every build from this venv then compiles with the same
# flags, so a wheel built later (tests/e2e/test_installed_wheel.py) reuses this install's
# objects in build/{wheel_tag} instead of compiling everything again (2 min on 2 cores).
BUILD_TOOLS = $(shell $(PYTHON) -c "import re; t = open('pyproject.toml').read(); \
  print(' '.join(repr(r) for r in re.findall(r'\"([^\"]+)\"', t.split('requires =', 1)[1].split(']', 1)[0])))") cmake ninja

$(STAMP): pyproject.toml CMakeLists.txt $(NATIVE)
	$(MAKE) system-deps
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(BUILD_TOOLS)
	$(PY) -m pip install -q --no-build-isolation -e '.[$(EXTRAS)]'
	touch $@

install: $(STAMP)

triton: $(STAMP)
	$(PY) -m triton_rec.runtime prepare

# The demo DLRM is trained here (deterministic, CPU, seconds); retrained when its code changes.
DLRM := model_repository/dlrm/1/dlrm_dense_0.model
$(DLRM): model_repository/dlrm/train.py examples/dlrm/torch_dlrm.py | $(STAMP)
	$(PY) model_repository/dlrm/train.py

demo: $(STAMP) $(DLRM)
	$(PY) -m ps_loader demo model_repository

serve: triton demo
	$(PY) -m triton_rec.runtime serve --model-repository model_repository

# ruff (rules and formatting: [tool.ruff] in pyproject.toml), clang-format (src/.clang-format),
# mypy over the engine ([tool.mypy]).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run -Werror $(CXX_SOURCES)
	$(VENV)/bin/mypy triton_rec

test: $(STAMP) demo
	$(VENV)/bin/pytest tests

# No Redis, no Kafka, no tritonserver, nothing slow by design: the tests marked redis/kafka/server
# (tests/conftest.py) and slow are left out; `make test` runs them.
unit: $(STAMP)
	$(VENV)/bin/pytest -m "not redis and not kafka and not server and not slow" tests/unit

e2e: $(STAMP) demo
	$(VENV)/bin/pytest tests/e2e

bench: $(STAMP)
	$(PY) benchmarks/bench_lookup.py

# The generated MLPerf-shaped DLRM (ps-loader criteo-dlrm) served beside the native floor with
# its inputs and outputs, perf_analyzer at c=1 and 2 (benchmarks/bench_criteo.py): the CPU rows
# at scale 0.01 (1 GB of tables, generated once under the temp dir and reused); raw JSON in
# benchmarks/data/criteo_cpu_<machine>.json. CRITEO_ARGS: more options, e.g.
# CRITEO_ARGS="--batch-sizes 256,1024,4096 --instances 4".
CRITEO_ARGS ?=
bench-criteo: $(STAMP)
	$(PY) benchmarks/bench_criteo.py --scale 0.01 --kind KIND_CPU $(CRITEO_ARGS)

# The MLPerf-shaped DLRM's network in-process beside onnxruntime and PyTorch; the accuracy of
# the GPU's reduced-precision dense layers (dense_math), measured with their host twin.
bench-dense: $(STAMP)
	$(PY) benchmarks/bench_dense_cpu.py
bench-dense-math: $(STAMP)
	$(PY) benchmarks/bench_dense_math.py

# perf_analyzer with its library path set, against a running server: make perf ARGS="-m hps_demo ..."
perf: $(STAMP)
	$(VENV)/bin/triton-rec-perf $(ARGS)

# docs/performance.md and the README's headline figures, generated from benchmarks/data/ and
# benchmarks/targets.json by benchmarks/perf_docs.py (plain Python, no install needed);
# tests/unit/test_perf_docs.py fails when either differs from what it writes now.
.PHONY: perf-docs
perf-docs:
	$(PY_IN_USE) benchmarks/perf_docs.py

clean:
	rm -rf build $(VENV) model_repository/*/1/*.model

# On a machine with a GPU: the GPU tests (tests/gpu, `pytest -m gpu`: kernels against the
# numpy reference, CUDA IPC between processes, device tables, dense graphs, served models on
# both request paths), then the GPU benchmark with its floors. GPU_PY: a Python whose
# environment has this project (pip install -e .), CuPy and NVRTC (the gpu extra); GPU_OUT:
# where the logs and the JSON go; GPU_BENCH_ARGS / GPU_SERVED_ARGS: the benchmarks' options.
# Does not install anything (a GPU node may have no network:
# docs/operations.md, "On a GPU node").
GPU_PY  ?= $(PY)
GPU_OUT ?= benchmarks/out
GPU_BENCH_ARGS  ?=
GPU_SERVED_ARGS ?=
GPU_CRITEO_ARGS ?=
gpu-check: gpu-tests gpu-bench gpu-served
gpu-tests gpu-bench gpu-served gpu-criteo gpu-criteo-tf32: SHELL := /bin/bash
gpu-tests:
	mkdir -p $(GPU_OUT)
	set -o pipefail; $(GPU_PY) -m pytest -m gpu tests/gpu -q -rfE 2>&1 | tee $(GPU_OUT)/gpu_tests.log
gpu-bench:
	mkdir -p $(GPU_OUT)
	set -o pipefail; $(GPU_PY) benchmarks/bench_gpu.py $(GPU_BENCH_ARGS) --json $(GPU_OUT)/bench_gpu.json 2>&1 | tee $(GPU_OUT)/bench_gpu.log
gpu-served:
	mkdir -p $(GPU_OUT)
	set -o pipefail; $(GPU_PY) benchmarks/bench_gpu_served.py $(GPU_SERVED_ARGS) --json $(GPU_OUT)/bench_gpu_served.json 2>&1 | tee $(GPU_OUT)/bench_gpu_served.log
# Not part of gpu-check (benchmarks/gpu_node.sh runs it after): the generated MLPerf-shaped
# DLRM at scale 0.05 (4.9 GB of tables, ~10 GB of disk with the node store's copy; generated
# under the temp dir, not GPU_OUT), KIND_GPU with 2 instances (a request's host work, about
# 10 ms at 65,536 samples, overlaps the other's GPU work at c=2) at every batch size and
# concurrency 1 and 2, then KIND_CPU at batch 1,024 with 4 instances and concurrency up to 8
# (the CPU path at its best on every core, for issue 35's KIND_GPU / KIND_CPU ratio), each
# beside the native floor (benchmarks/bench_criteo.py; needs perf_analyzer:
# benchmarks/gpu_node.sh).
gpu-criteo:
	mkdir -p $(GPU_OUT)
	set -o pipefail; $(GPU_PY) benchmarks/bench_criteo.py --kind KIND_GPU --scale 0.05 --instances 2 --data-dir $(GPU_OUT) $(GPU_CRITEO_ARGS) 2>&1 | tee $(GPU_OUT)/bench_criteo.log
	set -o pipefail; $(GPU_PY) benchmarks/bench_criteo.py --kind KIND_CPU --scale 0.05 --data-dir $(GPU_OUT) --instances 4 --batch-sizes 1024 --concurrency 1,2,4,8 2>&1 | tee $(GPU_OUT)/bench_criteo_cpu.log
# The same model, KIND_GPU only, its dense layers on tensor cores (dense_math tf32:
# docs/precision.md); reuses gpu-criteo's generated files.
gpu-criteo-tf32:
	mkdir -p $(GPU_OUT)
	set -o pipefail; $(GPU_PY) benchmarks/bench_criteo.py --kind KIND_GPU --dense-math tf32 --scale 0.05 --instances 2 --data-dir $(GPU_OUT) $(GPU_CRITEO_ARGS) 2>&1 | tee $(GPU_OUT)/bench_criteo_tf32.log
