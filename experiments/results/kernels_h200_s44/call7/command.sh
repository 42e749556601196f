#!/bin/bash
# Session 44, call 7: "in_scores" the default (mosaic_gpu.DEFAULT_GATE_STATS): phase 2's GPU tests
# against the oracle, then the `base` step of Vanilla, MSAR with the new default and MSAR with
# "own_pass" (--kernel-option), one warm machine. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 100 python -m pytest -q -m gpu tests/kernels/test_mosaic_gpu_phase2.py -p no:cacheprovider \
    2>&1 | grep -E "passed|failed|Error|FAIL" | tail -8 | tee $OUT/gpu_test.txt
echo "gpu test $(( $(date +%s)-S ))s"
ARGS="--steps 2 --warmup 1 --top 8 --set model.residual.implementation=auto"
run() {  # label, config, extra arguments
  timeout 100 python experiments/profile_step.py configs/$2.py:size=base $ARGS "${@:3}" 2>&1 | grep -v Warning \
      > $OUT/step_$1.txt
  grep -m1 "median wall" $OUT/step_$1.txt | sed "s/^/$1: /"
  echo "step $1 $(( $(date +%s)-S ))s"
}
run vanilla vanilla
run msar msar
run msar_own_pass msar --kernel-option mosaic_gpu.DEFAULT_GATE_STATS=own_pass
grep -hE "phase2_mosaic " $OUT/step_msar.txt $OUT/step_msar_own_pass.txt
