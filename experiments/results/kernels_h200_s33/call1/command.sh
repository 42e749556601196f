#!/bin/bash
# Planned in session 33 (no device): the GPU tests of sessions 32-33's options, their kernel
# timings, and session 32's MHAR query-gradient A/B. Repository root, carry [".whl"]; ~9 minutes.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
env JAX_PLATFORMS=cuda timeout 200 python -m pytest -q -m gpu tests/kernels/test_upcast.py \
    tests/kernels/test_mosaic_gpu_phase1.py tests/kernels/test_mosaic_gpu_bwd1.py 2>&1 | tail -5 | tee $OUT/gpu_tests.txt
timeout 240 python experiments/mgpu/time_item_decode.py 2>&1 | grep -v Warning | tee $OUT/item_decode.txt
for f in batched all_heads; do
  timeout 100 python -m pallas_kernels.depth_attention.bench --backward pallas --configs mhar \
      --query_grads_heads $f 2>&1 | grep -v Warning | tail -4 | tee $OUT/bench_mhar_$f.txt
done
