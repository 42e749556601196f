#!/bin/bash
# Session 30, call 6: MSAR's `base` step after this session's changes (phase 1's custom_vjp now
# takes symbolic zeros; MSAR passes no value channel). Run from the repository root with carry
# [".whl"].
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 150 python experiments/profile_step.py configs/msar.py:size=base --steps 2 --warmup 1 --top 12 --set model.residual.implementation=auto 2>&1 | grep -v Warning | tee $OUT/step_msar.txt
