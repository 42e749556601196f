#!/bin/bash
# Session 46, call 5: phase 1's kernels at the issue's shape under Nsight Compute with no L2 hints
# and with call 4's second set (streamed data evict_first, re-read data evict_last): how many DRAM
# bytes the hints take off. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
M=$(python3 experiments/mgpu/ncu_census.py --metrics)
S=$(date +%s)
BOTH=stores=evict_first,large_f32_loads=evict_first,bf16_loads=evict_last,f32_rank5_loads=evict_last
for set in none $BOTH; do
  label=$([ $set = none ] && echo none || echo hinted)
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 ncu --clock-control none -k regex:mosaic --csv --print-units base \
      --metrics $M python3 -c "
import runpy, sys
import l2_hints, time_l2_hints
sys.argv = ['ncu_phase1.py', '--issue']
with l2_hints.hinted(time_l2_hints.parse_set('$set')):
    runpy.run_path('experiments/mgpu/ncu_phase1.py', run_name='__main__')
" > $OUT/ncu_p1_issue_$label.csv 2>> $OUT/ncu.err
  echo "ncu $label rc $? $(( $(date +%s)-S ))s"
  python3 experiments/mgpu/ncu_census.py $OUT/ncu_p1_issue_$label.csv --copy-tbps 2.83 --skip 'mix#2' | tee $OUT/census_$label.txt
done
