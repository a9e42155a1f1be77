#!/usr/bin/env bash
# Device check (issue 16): GPU tensors published and fetched into another process's GPU
# buffers over loopback TCP (pinned staging ring) and over CUDA IPC (dial "cuda-ipc"),
# next to cupy's device-to-device copy and pinned H2D/D2H measured in the same run.
# Figures: ipc_vs_d2d, staged_tcp_vs_min_link; the last stdout line is JSON.
#
#   tools/device_check.sh                 # 4 GiB, 3 fetches per leg, <= 5 minutes on an H200
#   tools/device_check.sh --size 1GiB --runs 2
#
# Needs cupy for the CUDA it has (cupy-cuda12x or -cuda13x; torch with CUDA is used too when present).  Offline machines:
# wheels fetched beforehand by tools/device_wheels.sh into .whl/ are installed from there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import cupy" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    echo "installing from .whl/ (offline) ..."
    "$PY" -m pip install -q --no-index --find-links .whl cupy-cuda12x || \
        echo "could not install cupy-cuda12x from .whl/"
fi
if ! "$PY" -c "import trio, zmq, msgpack, blake3, xxhash, nacl, zstandard" 2>/dev/null \
        && compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --find-links .whl \
        trio pyzmq msgpack numpy blake3 xxhash pynacl zstandard || \
        echo "could not install tensorhub's dependencies from .whl/"
fi
if compgen -G ".whl/torch-*.whl" >/dev/null && ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --find-links .whl torch || echo "no torch from .whl/"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 300 "$PY" tools/device_check.py --json "$@"
