#!/bin/bash
# Session 25, call 5: phase 1's backward GPU test (gdots' grouped stores); the MSAR base step with today's defaults.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 160 python3 -m pytest -v -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_bwd1.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|Error|passed|failed" $OUT/gpu_tests.txt | cut -c1-200 | tail -6
S=$(date +%s)
timeout 130 python3 experiments/profile_step.py configs/msar.py:size=base --steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto > $OUT/profile_msar.txt 2>&1; echo "profile msar rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p" $OUT/profile_msar.txt | cut -c1-160; grep -E "depth_attention" $OUT/profile_msar.txt | head -12 | cut -c1-160
