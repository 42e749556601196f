#!/bin/bash
# Session 35, call 1 (session 34's call 1, with dstreams' window fetch): (a) the GPU tests of
# session 33's default (gdots and dstreams carrying their next item), of the mix's and
# dstreams' lag windows once per chunk (window_fetch="per_chunk", sessions 34 and 35), and of
# phase 1's Mosaic kernels; (b) the mix with either window fetch. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
S=$(date +%s)
env JAX_PLATFORMS=cuda timeout 240 python -m pytest -q -m gpu -p no:cacheprovider --tb=short \
    tests/kernels/test_mosaic_gpu_bwd1.py tests/kernels/test_mosaic_gpu_phase1.py 2>&1 | grep -v Warning | tail -15 \
    | tee $OUT/gpu_tests.txt
echo "tests $(( $(date +%s)-S ))s"; S=$(date +%s)
timeout 240 python experiments/mgpu/time_phase1_mix.py --window-fetch 2>&1 | grep -v Warning | tee $OUT/window_fetch.txt
echo "mix window-fetch $(( $(date +%s)-S ))s"
