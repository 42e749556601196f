#!/bin/bash
# Session 17, call 4: shared lag windows in the Mosaic kernels; phase 1's scoring pass in Mosaic GPU; the base step with gpu_kernels=mosaic; phase 1's GPU test.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 90 python3 experiments/mgpu/time_phase2.py --base-only --msar-only > $OUT/time_phase2.txt 2>&1; echo "time_phase2 rc=$? $(( $(date +%s)-S ))s"; grep -v Warn $OUT/time_phase2.txt | tail -5
S=$(date +%s)
timeout 120 python3 experiments/mgpu/time_phase2.py --backward --base-only > $OUT/time_backward.txt 2>&1; echo "time_backward rc=$? $(( $(date +%s)-S ))s"; grep -v Warn $OUT/time_backward.txt | tail -6 | cut -c1-250
S=$(date +%s)
timeout 100 python3 experiments/mgpu/time_phase1_scores.py > $OUT/time_phase1_scores.txt 2>&1; echo "time_phase1_scores rc=$? $(( $(date +%s)-S ))s"; grep -v Warn $OUT/time_phase1_scores.txt | tail -9
S=$(date +%s)
timeout 150 python3 experiments/profile_step.py configs/msar.py:size=base --steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto --set model.residual.gpu_kernels=mosaic > $OUT/profile_msar_mosaic.txt 2>&1; echo "profile rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p;30,42p" $OUT/profile_msar_mosaic.txt | cut -c1-150
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 120 python3 -m pytest -v -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_phase1.py > $OUT/gpu_tests_phase1.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|passed|failed|Error" $OUT/gpu_tests_phase1.txt | tail -6
