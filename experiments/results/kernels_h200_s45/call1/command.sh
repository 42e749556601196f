#!/bin/bash
# Session 45, call 1: today's defaults (REREAD_ORDER = "reverse" since session 43, DEFAULT_GATE_STATS = "in_scores" since session 44) on the issue's
# device: the per-sublayer bench at the issue's shape (MSAR, then AttnRes), then the `base` step of
# Vanilla, MSAR and AttnRes. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
S=$(date +%s)
for c in msar attnres; do
  timeout 200 python -m pallas_kernels.depth_attention.bench --backward pallas --configs $c 2>&1 | grep -v Warning \
      | tail -8 > $OUT/bench_$c.txt
  grep -E "fwd:|fb:" $OUT/bench_$c.txt
  echo "bench $c $(( $(date +%s)-S ))s"
done
ARGS="--steps 2 --warmup 1 --top 8 --set model.residual.implementation=auto"
for c in vanilla msar attnres; do
  timeout 130 python experiments/profile_step.py configs/$c.py:size=base $ARGS 2>&1 | grep -v Warning > $OUT/step_$c.txt
  grep -m1 "median wall" $OUT/step_$c.txt | sed "s/^/$c: /"
  echo "step $c $(( $(date +%s)-S ))s"
done
