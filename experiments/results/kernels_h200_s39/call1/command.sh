#!/bin/bash
# Session 39 plan, call 1 (planned in session 38): session 38's H100 step ratios on an H200, the card
# issue 4 names: Vanilla, MSAR with the defaults and with the bf16 state + saved reads, AttnRes with
# the defaults and with the bf16 state, all in one call. Carry [".whl"]; about 7 minutes.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv
step() {  # name, config, extra --set flags
  local name=$1 cfg=$2; shift 2
  timeout 240 python experiments/profile_step.py configs/$cfg.py:size=base --steps 2 --warmup 1 --top 8 \
      --set model.residual.implementation=auto "$@" 2>&1 | grep -v Warning > $OUT/step_$name.txt
  grep -m1 "median wall" $OUT/step_$name.txt | sed "s/^/$name: /"
}
step vanilla vanilla
step msar msar
step msar_bf16_saved msar --set model.residual.state_dtype=bfloat16 --set model.save_read_outputs=True
step attnres attnres
step attnres_bf16 attnres --set model.residual.state_dtype=bfloat16
