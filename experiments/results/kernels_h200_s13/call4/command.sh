#!/bin/bash
# Session 13, call 4: the GPU test of save_read_outputs after its helper was shared (refactor check).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" tests/test_model_kernel_path.py > $OUT/gpu_test.txt 2>&1; echo "gpu test rc=$? $(( $(date +%s)-S ))s"; grep -E "^E|passed|failed" $OUT/gpu_test.txt | tail -5
