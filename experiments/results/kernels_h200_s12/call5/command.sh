#!/bin/bash
# Session 12, call 5: the committed fresh state (train.py) on the GPU: the resume test, in-process.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_train.py -k "resume_equals or nan_loss or sigterm" > $OUT/gpu_train_tests.txt 2>&1; echo "train tests on GPU rc=$? $(( $(date +%s)-S ))s"; tail -15 $OUT/gpu_train_tests.txt
