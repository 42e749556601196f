#!/bin/bash
# Session 43, call 1: phase 2's gated Mosaic kernels (the forward, the backward's state kernel)
# with the state's second read in the same chunk order or in reverse (mosaic_gpu.REREAD_ORDER),
# `base` and the issue's shape, three alternating rounds each; the GPU test of phase 2's Mosaic
# kernels (against the oracle, each order); then the `base` step of Vanilla, MSAR with today's
# defaults and MSAR with the reverse order (one machine start for all: the device refused four
# tries this session). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv
timeout 200 python experiments/mgpu/time_reread_order.py 2>&1 | grep -v Warning | tee $OUT/reread.txt
JAX_PLATFORMS=cuda timeout 150 python -m pytest -q -m gpu tests/kernels/test_mosaic_gpu_phase2.py \
    -p no:cacheprovider 2>&1 | grep -E "passed|failed|Error|FAIL" | tail -8 | tee $OUT/gpu_test.txt
ARGS="--steps 2 --warmup 1 --top 8 --set model.residual.implementation=auto"
run() {  # label, config, extra arguments
  timeout 130 python experiments/profile_step.py configs/$2.py:size=base $ARGS "${@:3}" 2>&1 | grep -v Warning \
      > $OUT/step_$1.txt
  grep -m1 "median wall" $OUT/step_$1.txt | sed "s/^/$1: /"
}
run vanilla vanilla
run msar msar
run msar_reverse msar --kernel-option mosaic_gpu.REREAD_ORDER=reverse
grep -E "phase2|bwd_state" $OUT/step_msar.txt $OUT/step_msar_reverse.txt | head -20
