#!/bin/bash
# Session 22, call 1: phase 1's backward passes 2 and 4 in Mosaic GPU (mosaic_gpu_bwd1) against Triton at base and the shape, with ptxas's register/spill report; the mixing and scoring passes' ptxas reports (spills?).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
MOSAIC_GPU_DUMP_PTXAS=1 timeout 200 python3 experiments/mgpu/time_phase1_bwd.py > $OUT/time_phase1_bwd.txt 2>&1; echo "phase1 bwd rc=$? $(( $(date +%s)-S ))s"; grep -E "^#|ms |FAIL" $OUT/time_phase1_bwd.txt | cut -c1-200; grep -iE "spill|registers|Compiling entry" $OUT/time_phase1_bwd.txt | cut -c1-160 | uniq -c | head -20
S=$(date +%s)
MOSAIC_GPU_DUMP_PTXAS=1 timeout 60 python3 experiments/mgpu/time_phase1_mix.py --base-only --padded > $OUT/time_phase1_mix.txt 2>&1; echo "phase1 mix rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms |FAIL" $OUT/time_phase1_mix.txt | cut -c1-200; grep -iE "spill|registers|Compiling entry" $OUT/time_phase1_mix.txt | cut -c1-160 | uniq -c | head -20
S=$(date +%s)
MOSAIC_GPU_DUMP_PTXAS=1 timeout 50 python3 experiments/mgpu/time_phase1_scores.py --base-only --padded > $OUT/time_phase1_scores.txt 2>&1; echo "phase1 scores rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms |FAIL" $OUT/time_phase1_scores.txt | cut -c1-200; grep -iE "spill|registers|Compiling entry" $OUT/time_phase1_scores.txt | cut -c1-160 | uniq -c | head -20
