#!/bin/bash
# Session 42, call 2: call 1's timings again (three slots; bf16 widened in place), for their spread.
# Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
for o in slots bits; do
  timeout 200 python experiments/mgpu/time_inner_loops.py --inputs-only --only $o 2>&1 | grep -v Warning | tee -a $OUT/inputs_repeat.txt
done
