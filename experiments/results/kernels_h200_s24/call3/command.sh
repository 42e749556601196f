#!/bin/bash
# Session 24, call 3: the model-level GPU test of the split forward under save_read_outputs, now against a float32 run; phase 2's backward with 1, 2, 4 and 8 batch rows per program of the input kernel at base and at the issue's shape.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 200 python3 -m pytest -v -p no:cacheprovider -m gpu -rP -o addopts="" tests/test_model_kernel_path.py -k "saved_read_outputs" > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|Error|passed|failed" $OUT/gpu_tests.txt | cut -c1-300 | tail -8; grep -E "relative L2" $OUT/gpu_tests.txt
S=$(date +%s)
timeout 200 python3 experiments/mgpu/time_phase2.py --backward --rows > $OUT/time_inputs_rows.txt 2>&1; echo "inputs rows rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|Error" $OUT/time_inputs_rows.txt | cut -c1-250
