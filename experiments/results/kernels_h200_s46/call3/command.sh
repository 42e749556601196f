#!/bin/bash
# Session 46, call 3: gdots with its g_A buffer refilled as soon as the group's tiles are in
# registers (mosaic_gpu_bwd1.GROUP_REFILLS' "after_load") against after the group's items, then
# phase 1's backward kernels' GPU test (every form against Triton's passes). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
S=$(date +%s)
timeout 200 python experiments/mgpu/time_phase1_bwd.py --group-refill after_items,after_load 2>&1 | grep -v Warning \
    > $OUT/time_gdots_refill.txt
grep -E "copy|##|gdots" $OUT/time_gdots_refill.txt
echo "timing $(( $(date +%s)-S ))s"
JAX_PLATFORMS=cuda timeout 300 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_mosaic_gpu_bwd1.py \
    2>&1 | tail -3 | tee $OUT/gpu_test.txt
echo "test $(( $(date +%s)-S ))s"
