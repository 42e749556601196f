#!/bin/bash
# Session 14, call 4: every GPU-marked test at the session's code.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" tests/ -rA > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/gpu_tests.txt | tail -12
