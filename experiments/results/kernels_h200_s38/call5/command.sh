#!/bin/bash
# Session 38, call 5: What remains 1's design options together (the bf16 state and the reads'
# outputs saved: `state_dtype=bfloat16`, `save_read_outputs=True`) in the MSAR `base` step, and
# Vanilla's step in the same call (session 24 measured the pair at 1.396x on the H200). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 240 python experiments/profile_step.py configs/msar.py:size=base --steps 2 --warmup 1 --top 12 \
    --set model.residual.implementation=auto --set model.residual.state_dtype=bfloat16 \
    --set model.save_read_outputs=True 2>&1 | grep -v Warning > $OUT/step_msar_bf16_state_saved_reads.txt
echo "msar $(( $(date +%s)-S ))s"; S=$(date +%s); head -12 $OUT/step_msar_bf16_state_saved_reads.txt
timeout 150 python experiments/profile_step.py configs/vanilla.py:size=base --steps 2 --warmup 1 --top 8 \
    --set model.residual.implementation=auto 2>&1 | grep -v Warning > $OUT/step_vanilla.txt
echo "vanilla $(( $(date +%s)-S ))s"; head -5 $OUT/step_vanilla.txt
