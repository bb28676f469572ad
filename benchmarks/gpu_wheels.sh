#!/usr/bin/env bash
# What benchmarks/gpu_node.sh installs on a GPU node without network, fetched here (with
# network) into WHEEL_DIR (default .whl): the Triton server wheel (nvidia-pytriton 0.7.0),
# tritonclient 2.50.0 (its perf_analyzer), the CUDA 12 runtime (libcudart.so.12, which
# perf_analyzer links) and Debian's libb64-0d. The two large wheels are slimmed to what
# the node uses, so that the checkout and these files travel in one 64 MiB call of the
# device tool: the server wheel without its Python 3.13 backend stub and the libpython 3.13
# that stub brings (the node's Python is 3.12), tritonclient without perf_client (a second
# copy of perf_analyzer); each wheel's RECORD is rewritten to match. About 52 MB in all.
#
#   benchmarks/gpu_wheels.sh [WHEEL_DIR] [PYTHON_VERSION]      # default .whl 3.12
set -euo pipefail
DIR=${1:-.whl}
PYV=${2:-3.12}
mkdir -p "$DIR"
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
get() {  # NAME==VERSION PLATFORM...
  local spec=$1
  shift
  local plats=()
  for p in "$@"; do plats+=(--platform "$p"); done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" \
    --implementation cp "${plats[@]}" -d "$raw" "$spec"
}
get nvidia-pytriton==0.7.0 manylinux_2_35_x86_64
get tritonclient==2.50.0 manylinux1_x86_64
get nvidia-cuda-runtime-cu12 manylinux2014_x86_64 manylinux_2_17_x86_64
(cd "$raw" && apt-get download libb64-0d >/dev/null 2>&1) || echo "libb64-0d: apt-get download failed; bring it yourself" >&2
python3 - "$raw" "$DIR" <<'EOF'
import glob, os, shutil, sys, zipfile

raw, out = sys.argv[1], sys.argv[2]
drop = {
    "nvidia_pytriton-": lambda n: "libpython3-" in n and ".13.so" in n
    or "/python_backend_stubs/3.13/" in n,
    "tritonclient-": lambda n: n.endswith("/bin/perf_client"),
}
for path in sorted(glob.glob(os.path.join(raw, "*"))):
    name = os.path.basename(path)
    rule = next((r for prefix, r in drop.items() if name.startswith(prefix)), None)
    target = os.path.join(out, name)
    if rule is None:
        shutil.copy(path, target)
        continue
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(
        target, "w", zipfile.ZIP_DEFLATED, compresslevel=9
    ) as zout:
        for item in zin.infolist():
            if rule(item.filename):
                continue
            data = zin.read(item.filename)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = [ln for ln in data.decode().splitlines() if not rule(ln.split(",")[0])]
                data = ("\n".join(lines) + "\n").encode()
            zout.writestr(item, data)
for f in sorted(os.listdir(out)):
    print(f"{os.path.getsize(os.path.join(out, f)) / 1e6:8.1f} MB  {f}")
EOF
