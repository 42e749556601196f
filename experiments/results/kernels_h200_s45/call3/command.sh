#!/bin/bash
# Session 45, call 3: call 2's census again (under `ncu -k regex:bwd1_` its process segfaulted as
# gdots launched): phase 1's kernels at the issue's shape with gdots and dstreams also in their
# "split" form (ncu_phase1.py --issue --split), every Mosaic kernel profiled as in session 44.
# Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name --format=csv,noheader
S=$(date +%s)
M=$(python3 experiments/mgpu/ncu_census.py --metrics)
timeout 300 ncu --clock-control none -k regex:mosaic --csv --print-units base --metrics $M \
    python3 experiments/mgpu/ncu_phase1.py --issue --split > $OUT/ncu_p1_issue_split.csv 2> $OUT/ncu.err
echo "ncu rc $? $(( $(date +%s)-S ))s"
python3 experiments/mgpu/ncu_census.py $OUT/ncu_p1_issue_split.csv --copy-tbps 2.77 | tee $OUT/census_split.txt
