#!/bin/bash
# Session 45, call 7: AttnRes per sublayer with the new defaults (its dstreams, one stream with the
# value channel's bf16 g_A, now brings its per-token rows once per (head, stream)). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
S=$(date +%s)
timeout 150 python -m pallas_kernels.depth_attention.bench --backward pallas --configs attnres 2>&1 | grep -v Warning \
    | tail -8 > $OUT/bench_attnres.txt
grep -E "copy bandwidth|fwd:|fb:" $OUT/bench_attnres.txt
echo "bench $(( $(date +%s)-S ))s"
