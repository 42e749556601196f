#!/bin/bash
# Session 22, call 2: phase 1's backward passes 2 and 4 in Mosaic GPU with (items in flight, g_A groups in shared memory) = (3, 2), (2, 1), (3, 1), with g_A in registers or read from shared memory per item: one or two programs per SM; ptxas report.
# (Re-run as recorded: the script took these variants by default then; they are now behind --variants.)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
MOSAIC_GPU_DUMP_PTXAS=1 timeout 300 python3 experiments/mgpu/time_phase1_bwd.py --variants > $OUT/time_phase1_bwd.txt 2>&1; echo "phase1 bwd rc=$? $(( $(date +%s)-S ))s"; grep -E "^#|ms |FAIL" $OUT/time_phase1_bwd.txt | cut -c1-200; grep -iE "spill|registers" $OUT/time_phase1_bwd.txt | cut -c1-120 | uniq -c
