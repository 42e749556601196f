#!/bin/bash
# Session 25, call 4: phase 1's Mosaic kernels with their TMA stores committed as one group and one by one, and the mix's stores spread over the next group's items; GPU tests of phase 1's kernels.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -v -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_phase1.py tests/kernels/test_mosaic_gpu_bwd1.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|Error|passed|failed" $OUT/gpu_tests.txt | cut -c1-200 | tail -12
cd experiments/mgpu
S=$(date +%s)
timeout 150 python3 time_phase1_mix.py --store-groups --bf16 > $OUT/time_mix_stores.txt 2>&1; echo "mix rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms |FAIL" $OUT/time_mix_stores.txt | cut -c1-150
S=$(date +%s)
timeout 100 python3 time_phase1_scores.py --store-groups > $OUT/time_scores_stores.txt 2>&1; echo "scores rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms |FAIL" $OUT/time_scores_stores.txt | cut -c1-150
S=$(date +%s)
timeout 150 python3 time_phase1_bwd.py --store-groups --base-only > $OUT/time_bwd_stores.txt 2>&1; echo "bwd rc=$? $(( $(date +%s)-S ))s"; grep -E "^#|ms |FAIL" $OUT/time_bwd_stores.txt | cut -c1-150
