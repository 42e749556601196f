#!/bin/bash
# Session 19, call 6: phase 2's Mosaic forward with the gate's statistics summed in the scoring pass (gate_stats="in_scores": two expansions instead of three), timed against "own_pass"; phase 2's GPU tests with it (the new default); the base step with it.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv > $OUT/nvidia_smi.txt 2>&1
S=$(date +%s)
timeout 80 python3 experiments/mgpu/time_phase2.py --base-only --msar-only --gate-stats > $OUT/time_phase2.txt 2>&1; echo "time_phase2 rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms |FAIL" $OUT/time_phase2.txt | cut -c1-200
S=$(date +%s)
timeout 130 python3 experiments/profile_step.py configs/msar.py:size=base --steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto > $OUT/profile_msar.txt 2>&1; echo "profile rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p;30,40p" $OUT/profile_msar.txt | cut -c1-150
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 170 python3 -m pytest -v -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_phase2.py > $OUT/gpu_tests_phase2.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|passed|failed|Error" $OUT/gpu_tests_phase2.txt | tail -8
