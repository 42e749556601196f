#!/bin/bash
# Session 17, call 2: shared-memory row-offset loads probe; GPU tests of the Mosaic kernels (auto takes both); the MSAR base step.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 90 python3 experiments/mgpu/offset_loads.py > $OUT/offset_loads.txt 2>&1; echo "offset_loads rc=$? $(( $(date +%s)-S ))s"; grep -v Warn $OUT/offset_loads.txt | tail -10
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 260 python3 -m pytest -v -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_phase2.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|passed|failed|Error" $OUT/gpu_tests.txt | tail -8
S=$(date +%s)
timeout 230 python3 experiments/profile_step.py configs/msar.py:size=base --steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto > $OUT/profile_msar.txt 2>&1; echo "profile rc=$? $(( $(date +%s)-S ))s"; sed -n "4,12p;30,45p" $OUT/profile_msar.txt | cut -c1-150
