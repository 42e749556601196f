#!/bin/bash
# Session 40, call 5 (run inline on call 4's warm H200): the `base` step of Vanilla and MSAR with
# today's defaults. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv
ARGS="--steps 2 --warmup 1 --top 8 --set model.residual.implementation=auto"
for c in vanilla msar; do
  timeout 200 python experiments/profile_step.py configs/$c.py:size=base $ARGS 2>&1 | grep -v Warning > $OUT/step_$c.txt
  grep -m1 "median wall" $OUT/step_$c.txt | sed "s/^/$c: /"
done
grep -E "bwd_inputs|transpose" $OUT/step_msar.txt
