#!/bin/bash
# Session 46, call 6: call 5 again with ncu_phase1.py started directly (its new --l2-hints option):
# phase 1's kernels at the issue's shape under Nsight Compute, without and with call 4's second
# hint set. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
M=$(python3 experiments/mgpu/ncu_census.py --metrics)
S=$(date +%s)
BOTH=stores=evict_first,large_f32_loads=evict_first,bf16_loads=evict_last,f32_rank5_loads=evict_last
for label in none hinted; do
  extra=$([ $label = hinted ] && echo "--l2-hints $BOTH")
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 ncu --clock-control none -k regex:mosaic --csv --print-units base \
      --metrics $M python3 experiments/mgpu/ncu_phase1.py --issue $extra > $OUT/ncu_p1_issue_$label.csv 2>> $OUT/ncu.err
  echo "ncu $label rc $? $(( $(date +%s)-S ))s"
  python3 experiments/mgpu/ncu_census.py $OUT/ncu_p1_issue_$label.csv --copy-tbps 2.83 --skip 'mix#2' | tee $OUT/census_$label.txt
done
