#!/bin/bash
# Session 40, call 6: the input kernel's GPU tests with its constants held and without Pallas'
# automatic barriers (call 4's ran past its timeout before printing). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv
JAX_PLATFORMS=cuda timeout 250 python -m pytest -v -m gpu tests/kernels/test_mosaic_gpu_inputs.py -k "own or per_program" \
    -p no:cacheprovider 2>&1 | grep -E "PASS|FAIL|passed|failed|rror" | tail -12 | tee $OUT/gpu_test_own_barriers.txt
