#!/bin/bash
# Session 47, call 4: on an H200 only (the card, not lent since session 43): the copy ceiling
# four ways, the per-sublayer bench of MSAR and AttnRes and the `base` steps of Vanilla, MSAR and
# AttnRes with today's defaults (session 45's call 1); on any other card nothing. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
S=$(date +%s)
ARGS="--steps 2 --warmup 1 --top 8 --set model.residual.implementation=auto"
if grep -q H200 $OUT/gpu.txt; then
  timeout 60 python3 experiments/mgpu/copy_ceiling.py 2>&1 | grep -v Warning | tee $OUT/copy_ceiling.txt
  for c in msar attnres; do
    timeout 200 python -m pallas_kernels.depth_attention.bench --backward pallas --configs $c 2>&1 | grep -v Warning \
        | tail -8 > $OUT/bench_$c.txt
    grep -E "fwd:|fb:" $OUT/bench_$c.txt
    echo "bench $c $(( $(date +%s)-S ))s"
  done
  for c in vanilla msar attnres; do
    timeout 130 python experiments/profile_step.py configs/$c.py:size=base $ARGS 2>&1 | grep -v Warning > $OUT/step_$c.txt
    grep -m1 "median wall" $OUT/step_$c.txt | sed "s/^/$c: /"
    echo "step $c $(( $(date +%s)-S ))s"
  done
  exit 0
fi
echo "not an H200: nothing run (calls 1-3 measured this session's H100 figures)"
