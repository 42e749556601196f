#!/bin/bash
# Session 41, call 1: phase 2's backward input kernel with one or two token tiles per fetch
# (mosaic_gpu.INPUTS_TILES_PER_FETCH), its bf16 widened by Mosaic GPU's conversion or in place
# (INPUTS_WIDEN) and its refills issued by the first or the last warpgroup (INPUTS_REFILLS), beside
# session 40's constants options, `base` and the issue's shape; then the kernel's GPU tests of the
# new options (against Triton's pass at 1e-5). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv
timeout 390 python experiments/mgpu/time_inner_loops.py --inputs-only 2>&1 | grep -v Warning | tee $OUT/inputs.txt
JAX_PLATFORMS=cuda timeout 190 python -m pytest -v -m gpu tests/kernels/test_mosaic_gpu_inputs.py -k "per_program" \
    -p no:cacheprovider 2>&1 | grep -E "PASS|FAIL|passed|failed|rror" | tail -12 | tee $OUT/gpu_test.txt
