#!/bin/bash
# Session 22, call 3: with phase 1's backward passes 2 and 4 in Mosaic GPU (gdots 2 items / 1 group, dstreams 3 / 2, g_A in registers): the GPU-marked Mosaic tests, the MSAR base step, the per-sublayer table.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_mosaic_gpu_bwd1.py tests/kernels/test_mosaic_gpu_phase1.py -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; tail -4 $OUT/gpu_tests.txt | cut -c1-300
S=$(date +%s)
timeout 150 python3 experiments/profile_step.py configs/msar.py:size=base --steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto > $OUT/profile_msar.txt 2>&1; echo "profile rc=$? $(( $(date +%s)-S ))s"; sed -n "1,12p" $OUT/profile_msar.txt | cut -c1-160; grep -iE "bwd1|mosaic|transpose|fusion" $OUT/profile_msar.txt | head -20 | cut -c1-160
S=$(date +%s)
timeout 150 python3 -m pallas_kernels.depth_attention.bench --backward pallas > $OUT/bench.txt 2>&1; echo "bench rc=$? $(( $(date +%s)-S ))s"; tail -30 $OUT/bench.txt | cut -c1-220
