#!/bin/bash
# Session 33, call 4: the GPU tests of phase 1's Mosaic kernels at 94c50cf (gdots and dstreams
# carrying their next item by default). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
env JAX_PLATFORMS=cuda timeout 170 python -m pytest -q -m gpu -p no:cacheprovider --tb=short \
    tests/kernels/test_mosaic_gpu_bwd1.py 2>&1 | grep -v Warning | tail -15 | tee $OUT/gpu_tests.txt
