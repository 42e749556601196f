#!/bin/bash
# Session 46, call 4: L2 eviction hints on the TMA copies of the mix, gdots and dstreams
# (experiments/mgpu/l2_hints.py): the streamed-once data (state stores, g_A loads) marked
# evict_first, then also the re-read data (lag windows, p / per-token rows) evict_last; each set
# against none, in one process, the first set again last for drift. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
S=$(date +%s)
FIRST=stores=evict_first,large_f32_loads=evict_first
BOTH=$FIRST,bf16_loads=evict_last,f32_rank5_loads=evict_last
timeout 420 python experiments/mgpu/time_l2_hints.py none $FIRST $BOTH none 2>&1 | grep -v Warning | tee $OUT/time_l2_hints.txt
echo "timing $(( $(date +%s)-S ))s"
