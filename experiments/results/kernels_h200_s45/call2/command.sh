#!/bin/bash
# Session 45, call 2: phase 1's backward kernels (gdots, dstreams) with a program per stream
# (mosaic_gpu_bwd1.STREAM_PROGRAMS "split": the m programs of a token tile side by side, so a
# chunk's lag window comes from DRAM once and from L2 for the other streams) against "joint" (one
# program walks every stream, today's), timed at both shapes (time_phase1_bwd.py --stream-programs
# joint,split); then the census of both forms at the issue's shape (ncu_phase1.py --issue --split,
# only the bwd1 kernels profiled). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
S=$(date +%s)
timeout 300 python experiments/mgpu/time_phase1_bwd.py --stream-programs joint,split 2>&1 | grep -v Warning \
    | tee $OUT/split.txt
echo "timing $(( $(date +%s)-S ))s"
M=$(python3 experiments/mgpu/ncu_census.py --metrics)
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 ncu --clock-control none -k regex:bwd1_ --csv --print-units base \
    --metrics $M python3 experiments/mgpu/ncu_phase1.py --issue --split > $OUT/ncu_p1_issue_split.csv 2> $OUT/ncu.err
echo "ncu rc $? $(( $(date +%s)-S ))s"
python3 experiments/mgpu/ncu_census.py $OUT/ncu_p1_issue_split.csv --copy-tbps \
    $(grep -m1 -o "copy bandwidth [0-9.]*" $OUT/split.txt | awk '{print $3}') | tee $OUT/census_split.txt
