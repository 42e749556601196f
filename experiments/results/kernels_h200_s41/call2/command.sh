#!/bin/bash
# Session 41, call 2: phase 1's expansion transpose with its bf16 rows widened in place
# (mosaic_gpu_bwd1.TRANSPOSE_WIDEN) against its taps per tile and per source (the default), `base`'s
# last block and the issue's shape; then phase 1's backward GPU test (it checks the widened transpose
# against Triton's at 1e-5). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv
timeout 250 python experiments/mgpu/time_inner_loops.py --transpose-only 2>&1 | grep -v Warning | tee $OUT/transpose.txt
JAX_PLATFORMS=cuda timeout 300 python -m pytest -v -m gpu tests/kernels/test_mosaic_gpu_bwd1.py \
    -k "match_the_triton_passes" -p no:cacheprovider 2>&1 | grep -E "PASS|FAIL|passed|failed|rror" | tail -6 \
    | tee $OUT/gpu_test.txt
