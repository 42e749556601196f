#!/bin/bash
# Session 24, call 4: the model-level GPU test of the split forward under save_read_outputs, with parameter noise 0.1 (at 0.3 the bf16 model's gradients are 79-84% from float32's on any path).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 250 python3 -m pytest -v -p no:cacheprovider -m gpu -rP -o addopts="" tests/test_model_kernel_path.py -k "scores_kernel_in_the_rerun" > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|Error|passed|failed" $OUT/gpu_tests.txt | cut -c1-300 | tail -8; grep -E "relative L2" $OUT/gpu_tests.txt
