#!/bin/bash
# Session 25, call 2: phase 1's Mosaic kernels with 16- against 32-channel chunks (block_d), at base and the shape (mix, scores) or base (gdots, dstreams), with ptxas' register counts.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
cd experiments/mgpu
S=$(date +%s)
MOSAIC_GPU_DUMP_PTXAS=1 timeout 200 python3 time_phase1_mix.py --bd16 --bf16 > $OUT/time_mix_bd16.txt 2>&1; echo "mix rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms |FAIL|per SM" $OUT/time_mix_bd16.txt | cut -c1-150; grep -iE "registers|spill" $OUT/time_mix_bd16.txt | cut -c1-120 | sort | uniq -c
S=$(date +%s)
MOSAIC_GPU_DUMP_PTXAS=1 timeout 120 python3 time_phase1_scores.py --bd16 > $OUT/time_scores_bd16.txt 2>&1; echo "scores rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms |FAIL" $OUT/time_scores_bd16.txt | cut -c1-150; grep -iE "registers|spill" $OUT/time_scores_bd16.txt | cut -c1-120 | sort | uniq -c
S=$(date +%s)
MOSAIC_GPU_DUMP_PTXAS=1 timeout 200 python3 time_phase1_bwd.py --bd16 --base-only > $OUT/time_bwd_bd16.txt 2>&1; echo "bwd rc=$? $(( $(date +%s)-S ))s"; grep -E "^#|ms |FAIL" $OUT/time_bwd_bd16.txt | cut -c1-150; grep -iE "registers|spill" $OUT/time_bwd_bd16.txt | cut -c1-120 | sort | uniq -c
