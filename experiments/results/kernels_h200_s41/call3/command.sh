#!/bin/bash
# Session 41, call 3: the `base` step of Vanilla and MSAR with today's defaults and with session 41's
# four options on (in the input kernel two tiles per fetch, bf16 widened in place and the refills by
# the last warpgroup; in the transpose bf16 widened in place: set before the step is built), one warm
# machine. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv
ARGS="--steps 2 --warmup 1 --top 8 --set model.residual.implementation=auto"
timeout 100 python experiments/profile_step.py configs/vanilla.py:size=base $ARGS 2>&1 | grep -v Warning > $OUT/step_vanilla.txt
timeout 200 python experiments/profile_step.py configs/msar.py:size=base $ARGS 2>&1 | grep -v Warning > $OUT/step_msar.txt
NEW="import sys, runpy; from pallas_kernels.depth_attention import mosaic_gpu, mosaic_gpu_bwd1
mosaic_gpu.INPUTS_TILES_PER_FETCH = 2; mosaic_gpu.INPUTS_WIDEN = 'bits'; mosaic_gpu.INPUTS_REFILLS = 'last'
mosaic_gpu_bwd1.TRANSPOSE_WIDEN = 'bits'
sys.argv = ['experiments/profile_step.py', 'configs/msar.py:size=base'] + '$ARGS'.split()
runpy.run_path('experiments/profile_step.py', run_name='__main__')"
timeout 200 python -c "$NEW" 2>&1 | grep -v Warning > $OUT/step_msar_s41_options.txt
for f in vanilla msar msar_s41_options; do grep -m1 "median wall" $OUT/step_$f.txt | sed "s/^/$f: /"; grep -E "bwd_inputs|transpose" $OUT/step_$f.txt; done
