#!/bin/bash
# Session 36 (added to session 35's calls; run after call 4): (a) the GPU tests of the scoring pass
# with its query dots on the tensor cores (dots="tf32x3": TF32's rounding is only seen on a GPU);
# (b) the scoring pass with its dots on the CUDA cores (64 and 32 channels) against the tensor
# cores (one and two sets of E's parts), beside Triton, at `base`'s last block and the issue's
# shape; (c) MSAR per sublayer with the bf16 state option (state_dtype="bfloat16", not SPEC 5's
# default), today's kernels: how far the design option gets against the targets.
# Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
S=$(date +%s)
env JAX_PLATFORMS=cuda timeout 150 python -m pytest -q -m gpu -p no:cacheprovider --tb=short \
    tests/kernels/test_mosaic_gpu_phase1.py -k "scores or tensor" 2>&1 | grep -v Warning | tail -15 \
    | tee $OUT/gpu_tests.txt
echo "tests $(( $(date +%s)-S ))s"; S=$(date +%s)
timeout 200 python experiments/mgpu/time_phase1_scores.py --dots 2>&1 | grep -v Warning | tee $OUT/scores_dots.txt
echo "scores dots $(( $(date +%s)-S ))s"; S=$(date +%s)
timeout 220 python -m pallas_kernels.depth_attention.bench --backward pallas --configs msar \
    --state_dtype bfloat16 2>&1 | grep -v Warning | tail -8 | tee $OUT/bench_bf16_state.txt
cp bench_log.jsonl $OUT/ 2>/dev/null; echo "bench bf16 state $(( $(date +%s)-S ))s"
