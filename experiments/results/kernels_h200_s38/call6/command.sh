#!/bin/bash
# Session 38, call 6 (the H100 still warm from call 5): the default MSAR `base` step (float32 state)
# and AttnRes's, to set beside call 5's Vanilla on the same card. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
timeout 240 python experiments/profile_step.py configs/msar.py:size=base --steps 2 --warmup 1 --top 12 \
    --set model.residual.implementation=auto 2>&1 | grep -v Warning > $OUT/step_msar_default.txt
head -12 $OUT/step_msar_default.txt
timeout 150 python experiments/profile_step.py configs/attnres.py:size=base --steps 2 --warmup 1 --top 8 \
    --set model.residual.implementation=auto 2>&1 | grep -v Warning > $OUT/step_attnres.txt
head -4 $OUT/step_attnres.txt
