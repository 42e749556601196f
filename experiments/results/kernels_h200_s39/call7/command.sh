#!/bin/bash
# Session 39, call 7: rows_forward's two-pass form (one stream live at a time, the state tile read
# twice with the second read soon after the first, 4-32 tokens a program sharing the per-channel
# constants) against the Mosaic kernel, both shapes; then its GPU test. Carry [".whl"].
# Runs at commit f08d4f9 (the two-pass form was removed after this call).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv
timeout 100 python experiments/mgpu/time_rows_forward.py --only two-pass 2>&1 | grep -v Warning | tee $OUT/two_pass.txt
JAX_PLATFORMS=cuda timeout 60 python -m pytest -q -m gpu tests/kernels/test_rows_forward.py -k True -p no:cacheprovider \
    2>&1 | grep -v Warning | tail -4 | tee $OUT/gpu_test.txt
