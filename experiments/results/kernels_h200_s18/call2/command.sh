#!/bin/bash
# Session 18, call 2: phase 1's mixing pass in Mosaic GPU (timing against Triton, float32 and bf16 states); the base step with gpu_kernels=mosaic (which now includes it); phase 1's GPU tests (the scoring test's per-leaf tolerances, the mixing kernel's tests).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 200 python3 experiments/mgpu/time_phase1_mix.py --bf16 > $OUT/time_phase1_mix.txt 2>&1; echo "time_phase1_mix rc=$? $(( $(date +%s)-S ))s"; grep -v Warn $OUT/time_phase1_mix.txt | tail -17 | cut -c1-300
S=$(date +%s)
timeout 170 python3 experiments/profile_step.py configs/msar.py:size=base --steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto --set model.residual.gpu_kernels=mosaic > $OUT/profile_msar_mosaic_mix.txt 2>&1; echo "profile rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p;30,46p" $OUT/profile_msar_mosaic_mix.txt | cut -c1-150
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 240 python3 -m pytest -v -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_phase1.py > $OUT/gpu_tests_phase1.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|passed|failed|Error" $OUT/gpu_tests_phase1.txt | tail -12 | cut -c1-300
