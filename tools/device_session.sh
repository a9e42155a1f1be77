#!/usr/bin/env bash
# One call on a lent GPU machine: install the wheels tools/device_wheels.sh put in .whl/
# (into /tmp/site; the machine's own torch and cupy are used), run the GPU-related test
# files, then tools/device_check.sh at 1 GiB and at 4 GiB.  Logs go to $OUT when it is set.
#
#   tools/device_session.sh              # ~2 minutes on an H200
#   TESTS=0 tools/device_session.sh      # the device checks only
#   BIG=0 tools/device_session.sh        # without the 4 GiB check
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | tail -3
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import sys, numpy, cupy; print(sys.version.split()[0], 'numpy', numpy.__version__,
  'cupy', cupy.__version__, 'cuda', cupy.cuda.is_available())" || true
if [ "${TESTS:-1}" = 1 ]; then
    echo "=== GPU-related tests"
    timeout "${TEST_S:-150}" "$PY" -m pytest -q -p no:cacheprovider -rs \
        tests/test_device_buffers.py tests/test_staging.py tests/test_onesided_conformance.py \
        tests/test_onesided.py tests/test_dial.py tests/test_device_digest.py 2>&1 \
        | tee "$LOGS/tests.log" | tail -40
fi
echo "=== device check, 1 GiB"
timeout 150 tools/device_check.sh --size 1GiB --runs 3 2>&1 | tee "$LOGS/check1g.log" | tail -30
if [ "${BIG:-1}" = 1 ]; then
    echo "=== device check, 4 GiB"
    timeout 200 tools/device_check.sh --size 4GiB --runs 3 2>&1 | tee "$LOGS/check4g.log" \
        | tail -30
fi
