#!/bin/bash
# Session 30, call 5: the main table's MSAR row with phase 1 as the model hands it over (per
# target, the bench's new default) and stacked (sessions 1-29). Run from the repository root with
# carry [".whl"].
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 400 python -m pallas_kernels.depth_attention.bench --backward pallas --configs msar --p1_forms model,stacked 2>&1 | grep -v Warning | tail -8 | tee $OUT/bench.txt
cp bench_log.jsonl $OUT/ 2>/dev/null; true
