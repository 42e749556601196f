#!/bin/bash
# Session 38, call 7 (same H100): AttnRes's `base` step with the bf16 state, without and with the
# reads' outputs saved, and Vanilla's again. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
for extra in "" "--set model.save_read_outputs=True"; do
  timeout 100 python experiments/profile_step.py configs/attnres.py:size=base --steps 2 --warmup 1 --top 4 \
      --set model.residual.implementation=auto --set model.residual.state_dtype=bfloat16 $extra 2>&1 \
      | grep -v Warning | tee -a $OUT/step_attnres_bf16_state.txt | head -3
done
timeout 80 python experiments/profile_step.py configs/vanilla.py:size=base --steps 2 --warmup 1 --top 4 \
    --set model.residual.implementation=auto 2>&1 | grep -v Warning > $OUT/step_vanilla_again.txt
head -3 $OUT/step_vanilla_again.txt
