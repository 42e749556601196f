#!/bin/bash
# Session 34, call 1: (a) the GPU tests of session 33's default (gdots and dstreams carrying
# their next item) and of phase 1's Mosaic kernels; (b) what bounds the mixing pass: the default
# against itself without streams 1-3's lag windows, their p rows, both, or the state's stores
# (timing only, wrong outputs; session 25's Nsight samples put 16% of its warps' time in the
# four streams' slot waits, session 31 found deeper pipelines no faster); (c) the mix with a
# chunk's windows brought once for all four streams (window_fetch="per_chunk", new).
# Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
S=$(date +%s)
env JAX_PLATFORMS=cuda timeout 200 python -m pytest -q -m gpu -p no:cacheprovider --tb=short \
    tests/kernels/test_mosaic_gpu_bwd1.py tests/kernels/test_mosaic_gpu_phase1.py 2>&1 | grep -v Warning | tail -15 \
    | tee $OUT/gpu_tests.txt
echo "tests $(( $(date +%s)-S ))s"; S=$(date +%s)
timeout 200 python experiments/mgpu/time_phase1_mix.py --window-fetch 2>&1 | grep -v Warning | tee $OUT/window_fetch.txt
echo "window-fetch $(( $(date +%s)-S ))s"; S=$(date +%s)
timeout 200 python experiments/mgpu/time_phase1_mix.py --fetch-bound 2>&1 | grep -v Warning | tee $OUT/fetch_bound.txt
echo "fetch-bound $(( $(date +%s)-S ))s"
