#!/usr/bin/env bash
# Download, here, the wheels tools/device_check.sh installs offline on a GPU machine that
# cannot reach a package registry: cupy-cuda12x and tensorhub's own dependencies, into
# .whl/ (gitignored).  Carry .whl/ along with the working tree.
#
#   tools/device_wheels.sh                    # for this machine's Python version
#   PYVER=3.12 tools/device_wheels.sh         # for another Python on the GPU machine
#   WITH_TORCH=1 tools/device_wheels.sh       # also torch (CUDA 12 build: ~2.5 GB)
#   CUPY=0 PYVER=3.12 tools/device_wheels.sh  # a machine with torch and cupy already (this
#                                             # project's H200 image): ~9 MB of wheels
#
# Sizes: cupy-cuda12x is ~100 MB and torch's CUDA wheel ~2.5 GB; a transfer that caps
# what travels (the device tool carries 64 MiB) fits neither: there, use the GPU
# machine's own cupy/torch if it has them, or a machine with a registry mirror.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PYVER=${PYVER:-$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
mkdir -p .whl
common=(--dest .whl --only-binary=:all: --platform manylinux2014_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
        --python-version "$PYVER")
if [ "${CUPY:-1}" = 1 ]; then
    "$PY" -m pip download "${common[@]}" "cupy-cuda12x>=13" \
        "trio>=0.27" "pyzmq>=26" "msgpack>=1.0" "numpy>=1.26" "blake3>=0.4" "xxhash>=4.1" \
        "pynacl>=1.5" "zstandard>=0.22"
else  # the GPU machine has numpy, msgpack, xxhash, torch and cupy: only what it lacks
    "$PY" -m pip download "${common[@]}" --no-deps trio outcome sniffio pyzmq blake3 \
        pynacl cffi pycparser zstandard pytest-trio
fi
if [ "${WITH_TORCH:-0}" = 1 ]; then
    "$PY" -m pip download "${common[@]}" --index-url https://download.pytorch.org/whl/cu124 \
        --extra-index-url https://pypi.org/simple "torch==2.13.0"
fi
du -sh .whl
