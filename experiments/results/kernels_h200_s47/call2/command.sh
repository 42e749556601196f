#!/bin/bash
# Session 47, call 2: on an H200 session 45's call 1 (the per-sublayer bench of MSAR and AttnRes, the
# `base` steps of Vanilla, MSAR and AttnRes with today's defaults: the issue's card, not lent since
# session 43); on an H100 the `base` steps of Vanilla and of MSAR with the two design options the
# floors ask for (a bf16 state and the reads' outputs saved), last measured together in session 39
# on an H200 (1.375x). Carry [".whl"].
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
timeout 130 python experiments/profile_step.py configs/vanilla.py:size=base $ARGS 2>&1 | grep -v Warning > $OUT/step_vanilla.txt
grep -m1 "median wall" $OUT/step_vanilla.txt | sed "s/^/vanilla: /"
echo "step vanilla $(( $(date +%s)-S ))s"
timeout 200 python experiments/profile_step.py configs/msar.py:size=base $ARGS --set model.save_read_outputs=true \
    --set model.residual.state_dtype=bfloat16 2>&1 | grep -v Warning > $OUT/step_msar_relaxed.txt
grep -m1 "median wall" $OUT/step_msar_relaxed.txt | sed "s/^/msar bf16 state + saved reads: /"
grep -m1 "memory:" $OUT/step_msar_relaxed.txt
echo "step msar relaxed $(( $(date +%s)-S ))s"
