#!/bin/bash
# Session 16, call 2: the cached kernel build; where fwd + bwd's extra time goes; the base step.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 100 python3 experiments/mgpu/time_phase2.py --profile > $OUT/profile_p2.txt 2>&1; echo "profile_p2 rc=$? $(( $(date +%s)-S ))s"; grep -v "^W\|^E\|Warn" $OUT/profile_p2.txt | tail -40
S=$(date +%s)
timeout 230 python3 experiments/profile_step.py configs/msar.py:size=base --steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto > $OUT/profile_msar.txt 2>&1; echo "msar rc=$? $(( $(date +%s)-S ))s"; grep -E "median|memory" $OUT/profile_msar.txt; grep -A14 "Pallas kernel" $OUT/profile_msar.txt | head -16
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_phase2.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; tail -3 $OUT/gpu_tests.txt
