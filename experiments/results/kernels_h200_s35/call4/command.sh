#!/bin/bash
# Session 35, call 4 (session 34's call 3): the main table at the issue's shape with today's
# defaults (gdots and dstreams carrying their next item since session 33) and the flop-floor
# column (session 34): MSAR and AttnRes per sublayer. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 500 python -m pallas_kernels.depth_attention.bench --backward pallas --configs msar,attnres 2>&1 \
    | grep -v Warning | tail -12 | tee $OUT/bench.txt
cp bench_log.jsonl $OUT/ 2>/dev/null; echo "bench $(( $(date +%s)-S ))s"
