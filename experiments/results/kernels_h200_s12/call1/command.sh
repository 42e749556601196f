#!/bin/bash
# Session 12, call 1: the gate's W in the [m, m, d] layout: GPU tests; base MSAR.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
P="--steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto"
S=$(date +%s)
timeout 130 python3 experiments/profile_step.py configs/msar.py:size=base $P --json $OUT/profile_msar.json > $OUT/profile_msar.txt 2>&1; echo "msar rc=$? $(( $(date +%s)-S ))s"; grep -E "median|memory" $OUT/profile_msar.txt
grep -A12 "Pallas kernel" $OUT/profile_msar.txt
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_depth_attention_fused.py tests/kernels/test_fused_bwd_phase2.py -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; tail -3 $OUT/gpu_tests.txt
S=$(date +%s)
timeout 100 python3 experiments/profile_step.py configs/vanilla.py:size=base --steps 2 --warmup 1 --top 10 --json $OUT/profile_vanilla.json > $OUT/profile_vanilla.txt 2>&1; echo "vanilla rc=$? $(( $(date +%s)-S ))s"; grep -E "median|memory" $OUT/profile_vanilla.txt
