#!/bin/bash
# Session 40, call 3: the `base` step of Vanilla and MSAR with the new defaults (the input kernel's
# constants held per program, the transpose's taps per source) and with the old ones (per use, per
# tile: set before the step is built), in one call. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv
ARGS="--steps 2 --warmup 1 --top 8 --set model.residual.implementation=auto"
timeout 100 python experiments/profile_step.py configs/vanilla.py:size=base $ARGS 2>&1 | grep -v Warning > $OUT/step_vanilla.txt
timeout 200 python experiments/profile_step.py configs/msar.py:size=base $ARGS 2>&1 | grep -v Warning > $OUT/step_msar.txt
OLD="import sys, runpy; from pallas_kernels.depth_attention import mosaic_gpu, mosaic_gpu_bwd1
mosaic_gpu.INPUTS_CONSTANTS = 'per_use'; mosaic_gpu_bwd1.TRANSPOSE_TAPS = 'per_tile'
sys.argv = ['experiments/profile_step.py', 'configs/msar.py:size=base'] + '$ARGS'.split()
runpy.run_path('experiments/profile_step.py', run_name='__main__')"
timeout 200 python -c "$OLD" 2>&1 | grep -v Warning > $OUT/step_msar_old_defaults.txt
for f in vanilla msar msar_old_defaults; do grep -m1 "median wall" $OUT/step_$f.txt | sed "s/^/$f: /"; grep -E "bwd_inputs|transpose" $OUT/step_$f.txt; done
