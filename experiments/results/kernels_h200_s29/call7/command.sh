#!/bin/bash
# Session 29, call 7: MHAR's row of the main table (one stream, 8 channel heads) at the issue's
# shape, and its reads under the profiler. Run from the repository root with carry [".whl"].
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
python -m pallas_kernels.depth_attention.bench --backward pallas --configs mhar 2>&1 | grep -v Warning | tail -6 | tee $OUT/bench.txt
python experiments/mgpu/profile_bench_reads.py --configs mhar --calls 10 2>&1 | grep -v Warning | tee $OUT/profile.txt
