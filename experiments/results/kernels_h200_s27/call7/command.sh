#!/bin/bash
# Session 27, call 7: one stream's scoring pass with 256-channel chunks; phase 2's Triton forward
# (what AttnRes runs) with other tiles. Run from the repository root.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
python experiments/mgpu/time_phase1_scores.py --attnres --wide 2>&1 | grep -v Warning | tee $OUT/scores_attnres_wide.txt
python experiments/mgpu/time_phase2.py --triton-tiles --attnres-only 2>&1 | grep -v Warning | tee $OUT/phase2_forward_attnres_tiles.txt
