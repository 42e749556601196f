#!/bin/bash
# Session 33, call 2: why test_bits_upcast_gives_the_same_bits_on_the_gpu failed in call 1 (its
# traceback), then the MSAR `base` step with today's defaults and with the carried item decode
# in gdots and dstreams only (call 1: 4-6% faster there, the mix +-1%). Carry [".whl"].
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
env JAX_PLATFORMS=cuda timeout 170 python -m pytest -q -m gpu -x --tb=short -p no:cacheprovider \
    tests/kernels/test_upcast.py 2>&1 | grep -v Warning | tail -40 | tee $OUT/gpu_test_upcast.txt
for dec in divide carried; do
  timeout 170 python -c "
import sys; sys.path.insert(0, 'experiments')
from pallas_kernels.depth_attention import mosaic_gpu_bwd1
mosaic_gpu_bwd1.DEFAULT_ITEM_DECODE = '$dec'
import profile_step
profile_step.main(['configs/msar.py:size=base', '--steps', '2', '--warmup', '1', '--top', '8',
                   '--set', 'model.residual.implementation=auto'])" 2>&1 | grep -v Warning | tail -25 | tee $OUT/step_msar_bwd1_$dec.txt
done
