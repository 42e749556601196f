#!/bin/bash
# Session 40, call 4: the input kernel with and without Pallas' automatic barriers
# (mosaic_gpu.INPUTS_AUTO_BARRIERS), `base` and the issue's shape; its GPU tests (the options
# against Triton's pass); then the per-sublayer bench at the shape with today's defaults
# (MSAR row; may not finish inside the call). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv
timeout 150 python experiments/mgpu/time_inner_loops.py --inputs-only 2>&1 | grep -v Warning | tee $OUT/inputs.txt
JAX_PLATFORMS=cuda timeout 150 python -m pytest -q -m gpu tests/kernels/test_mosaic_gpu_inputs.py -p no:cacheprovider \
    2>&1 | grep -E "passed|failed|Error|FAIL" | tail -8 | tee $OUT/gpu_test.txt
S=$(date +%s)
timeout 230 python -m pallas_kernels.depth_attention.bench --backward pallas --configs msar 2>&1 | grep -v Warning \
    | tail -8 | tee $OUT/bench_msar.txt
echo "bench $(( $(date +%s)-S ))s"
