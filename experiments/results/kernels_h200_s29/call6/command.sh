#!/bin/bash
# Session 29, call 6: the `base` steps of Vanilla, AttnRes and MSAR in one call (the kernels'
# "auto" choices), for same-call ratios after this session's changes. Run from the repository
# root with carry [".whl"].
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for cfg in vanilla attnres msar; do
  python experiments/profile_step.py configs/$cfg.py:size=base --steps 2 --warmup 1 --top 12 --set model.residual.implementation=auto 2>&1 | grep -v Warning | tee $OUT/step_$cfg.txt
done
