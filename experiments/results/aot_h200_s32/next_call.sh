#!/bin/bash
# Planned in session 32, which had no device: the H200 timings of its two untimed options (README,
# "Predictions"). Run from the repository root with carry [".whl"]; about 9 minutes.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
env JAX_PLATFORMS=cuda python -m pytest -q -m gpu tests/kernels/test_mosaic_gpu_phase1.py \
    tests/kernels/test_mosaic_gpu_bwd1.py 2>&1 | tail -3 | tee $OUT/gpu_tests.txt
timeout 240 python experiments/mgpu/time_item_decode.py 2>&1 | grep -v Warning | tee $OUT/item_decode.txt
for f in batched all_heads; do
  timeout 150 python -m pallas_kernels.depth_attention.bench --backward pallas --configs mhar \
      --query_grads_heads $f 2>&1 | grep -v Warning | tail -4 | tee $OUT/bench_mhar_$f.txt
done
for dec in divide carried; do
  timeout 150 python -c "
import sys; sys.path.insert(0, 'experiments')
from pallas_kernels.depth_attention import mosaic_gpu, mosaic_gpu_bwd1
mosaic_gpu.DEFAULT_MIX_ITEM_DECODE = mosaic_gpu_bwd1.DEFAULT_ITEM_DECODE = '$dec'
import profile_step
profile_step.main(['configs/msar.py:size=base', '--steps', '2', '--warmup', '1', '--top', '8',
                   '--set', 'model.residual.implementation=auto'])" 2>&1 | grep -v Warning | tee $OUT/step_msar_$dec.txt
done
