#!/bin/bash
# Session 45, call 6: the `base` step of Vanilla and MSAR with the new defaults (gdots and dstreams
# with a program per stream, dstreams' rows once per (head, stream)). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
S=$(date +%s)
ARGS="--steps 2 --warmup 1 --top 8 --set model.residual.implementation=auto"
for c in vanilla msar; do
  timeout 130 python experiments/profile_step.py configs/$c.py:size=base $ARGS 2>&1 | grep -v Warning > $OUT/step_$c.txt
  grep -m1 "median wall" $OUT/step_$c.txt | sed "s/^/$c: /"
  echo "step $c $(( $(date +%s)-S ))s"
done
