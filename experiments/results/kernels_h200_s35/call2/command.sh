#!/bin/bash
# Session 35, call 2: (a) dstreams with either window fetch (new: a chunk's windows once for its
# four streams' groups) beside Triton's pass, at `base`'s last block and the issue's shape;
# (b) what bounds the mixing pass: the default against itself without streams 1-3's lag
# windows, their p rows, both, or the state's stores (timing only, wrong outputs).
# Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 280 python experiments/mgpu/time_phase1_bwd.py --window-fetch --dstreams-only 2>&1 | grep -v Warning \
    | tee $OUT/dstreams_window_fetch.txt
echo "dstreams window-fetch $(( $(date +%s)-S ))s"; S=$(date +%s)
timeout 240 python experiments/mgpu/time_phase1_mix.py --fetch-bound 2>&1 | grep -v Warning | tee $OUT/fetch_bound.txt
echo "fetch-bound $(( $(date +%s)-S ))s"
