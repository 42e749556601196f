#!/bin/bash
# Session 37 plan, call 1: what holds the mixing pass now that its windows come once per chunk
# (time_phase1_mix.py --fetch-bound: per chunk without streams 1-3's p rows or without the
# state's stores; per item with session 34's skips), then AttnRes's and MSAR's main-table rows
# with today's defaults. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 260 python experiments/mgpu/time_phase1_mix.py --fetch-bound 2>&1 | grep -v Warning | tee $OUT/fetch_bound.txt
echo "fetch-bound $(( $(date +%s)-S ))s"; S=$(date +%s)
timeout 300 python -m pallas_kernels.depth_attention.bench --backward pallas --configs attnres,msar 2>&1 \
    | grep -v Warning | tail -12 | tee $OUT/bench.txt
cp bench_log.jsonl $OUT/ 2>/dev/null; echo "bench $(( $(date +%s)-S ))s"
