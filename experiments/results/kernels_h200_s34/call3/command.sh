#!/bin/bash
# Session 34, call 3: what bounds phase 1's mixing pass. Session 25's Nsight Compute samples put
# 16% of its warps' time in the four streams' slot waits (SYNCS TRYWAIT loops: the items' copies
# not landed) and session 31 found more items in flight no faster: is the fill of shared memory
# (each source's lag window brought once per stream, its p rows once per chunk) the bound? The
# default against itself without streams 1-3's windows, their p rows, both, or the state's
# stores (timing only: wrong outputs). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 400 python experiments/mgpu/time_phase1_mix.py --fetch-bound 2>&1 | grep -v Warning | tee $OUT/fetch_bound.txt
echo "fetch-bound $(( $(date +%s)-S ))s"
