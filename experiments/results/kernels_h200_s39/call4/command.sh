#!/bin/bash
# Session 39, call 4: rows_forward's GPU test (the compiled Triton kernel with masked lag loads,
# against the oracle and the Mosaic kernel). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv
JAX_PLATFORMS=cuda timeout 400 python -m pytest -q -m gpu tests/kernels/test_rows_forward.py -p no:cacheprovider 2>&1 \
    | grep -v Warning | tail -15 | tee $OUT/gpu_test.txt
