#!/bin/bash
# Session 45, call 4: phase 1's backward kernels' GPU tests (compiled against the Triton passes,
# now with gdots' default "split" programs, both stream programs and dstreams' rows per stream),
# then dstreams with its per-token rows once per (head, stream) (mosaic_gpu_bwd1.ROWS_FETCHES
# "per_stream") against once per item, with one program for all streams and one per stream, both
# shapes (time_phase1_bwd.py --dstreams-only). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 150 python -m pytest -q -m gpu tests/kernels/test_mosaic_gpu_bwd1.py -p no:cacheprovider \
    2>&1 | grep -E "passed|failed|Error|FAIL|assert" | tail -12 | tee $OUT/gpu_test.txt
echo "gpu test $(( $(date +%s)-S ))s"
timeout 300 python experiments/mgpu/time_phase1_bwd.py --dstreams-only --stream-programs joint,split \
    --rows-fetch per_item,per_stream 2>&1 | grep -v Warning | tee $OUT/rows.txt
echo "timing $(( $(date +%s)-S ))s"
