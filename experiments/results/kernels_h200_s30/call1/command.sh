#!/bin/bash
# Session 30, call 1: the value channel (phase 1's value cotangent factored for one-stream reads):
# its GPU tests and those of the kernels it touches, then the main table's AttnRes and MHAR rows
# with phase 1 as the model runs it (value_channel), per target and stacked (sessions 1-29).
# Run from the repository root with carry [".whl"].
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
JAX_PLATFORMS=cuda python -m pytest -q -m gpu tests/kernels/test_value_channel.py tests/kernels/test_fused_bwd_phase2.py tests/kernels/test_bf16_output.py 2>&1 | tail -8 | tee $OUT/gpu_tests.txt
python -m pallas_kernels.depth_attention.bench --backward pallas --configs attnres,mhar --p1_forms model,per_target,stacked 2>&1 | grep -v Warning | tail -16 | tee $OUT/bench.txt
cp bench_log.jsonl $OUT/ 2>/dev/null; true
