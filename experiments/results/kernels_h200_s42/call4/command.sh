#!/bin/bash
# Session 42, call 4: phase 1's expansion transpose with 2 (the default), 3 or 4 items in flight
# (mosaic_gpu_bwd1.TRANSPOSE_SLOTS), `base`'s last block and the issue's shape; then its GPU test
# (every slot count against the default's bits, the default against Triton's pass); phase 2's input
# kernel with 2, 3 (the default) and 4 tiles in flight. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
timeout 200 python experiments/mgpu/time_inner_loops.py --transpose-only --only slots 2>&1 | grep -v Warning \
    | tee $OUT/transpose.txt
timeout 200 python experiments/mgpu/time_inner_loops.py --inputs-only --only slots 2>&1 | grep -v Warning \
    | tee $OUT/inputs.txt
JAX_PLATFORMS=cuda timeout 150 python -m pytest -q -m gpu tests/kernels/test_mosaic_gpu_bwd1.py -p no:cacheprovider \
    2>&1 | grep -E "passed|failed|Error|FAIL" | tail -8 | tee $OUT/gpu_test.txt
