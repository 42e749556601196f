#!/bin/bash
# Session 27, call 5: Triton's phase-1 mixing pass for one stream (what "auto" runs for AttnRes and
# MHAR) with its tiles and seven smaller ones, float32 state. Run from the repository root.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
python experiments/mgpu/time_phase1_mix.py --attnres --triton-tiles --small-tiles 2>&1 | grep -v Warning | tee $OUT/mix_attnres_tiles.txt
