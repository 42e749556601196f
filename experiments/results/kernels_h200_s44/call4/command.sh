#!/bin/bash
# Session 44, call 4: phase 1's backward kernels (gdots, dstreams) with each lag-window placement
# (time_phase1_bwd.py --windows: "padded", the default, against "single", whose 64-byte rows touch
# two 32-byte sectors where "padded"'s 80-byte rows touch three, and "aligned"), both shapes; then
# the census of phase 1's six kernels at the issue's shape with "single" windows everywhere
# (ncu_phase1.py --windows single). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
S=$(date +%s)
timeout 330 python experiments/mgpu/time_phase1_bwd.py --windows padded,single,aligned 2>&1 | grep -v Warning \
    | tee $OUT/windows.txt
echo "timing $(( $(date +%s)-S ))s"
M=$(python3 experiments/mgpu/ncu_census.py --metrics)
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 ncu --clock-control none -k regex:mosaic --csv --print-units base \
    --metrics $M python3 experiments/mgpu/ncu_phase1.py --issue --windows single > $OUT/ncu_p1_issue_single.csv \
    2> $OUT/ncu.err
echo "ncu rc $? $(( $(date +%s)-S ))s"
python3 experiments/mgpu/ncu_census.py $OUT/ncu_p1_issue_single.csv --copy-tbps \
    $(grep -m1 -o "copy bandwidth [0-9.]*" $OUT/windows.txt | awk '{print $3}') | tee $OUT/census_single.txt
