#!/bin/bash
# Session 24, call 2: phase 2's Mosaic forward split in two kernels (scores, then merge + gate + h) against one kernel, and its scores kernel alone; GPU tests (the split under save_read_outputs in a model, the phase-2 kernels, the input kernel's whole-tile cases); the MSAR base step with save_read_outputs ("auto" now "split_forward"), with the bf16 state and with the float32 one.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 120 python3 experiments/mgpu/time_phase2.py --split --msar-only > $OUT/time_split.txt 2>&1; echo "split rc=$? $(( $(date +%s)-S ))s"; grep -vE "Warning|warn" $OUT/time_split.txt | grep -E "##|mosaic|FAIL|Error|copy" | cut -c1-200
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 200 python3 -m pytest -v -p no:cacheprovider -m gpu -o addopts="" tests/test_model_kernel_path.py -k "saved_read_outputs" tests/kernels/test_mosaic_gpu_phase2.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|Error|passed|failed" $OUT/gpu_tests.txt | cut -c1-200 | tail -8
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 100 python3 -m pytest -v -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_inputs.py -k "320 and not 3-True" > $OUT/gpu_tests_inputs.txt 2>&1; echo "gpu tests inputs rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|Error|passed|failed" $OUT/gpu_tests_inputs.txt | cut -c1-200 | tail -5
S=$(date +%s)
timeout 120 python3 experiments/profile_step.py configs/msar.py:size=base --steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto --set model.save_read_outputs=true --set model.residual.state_dtype=bfloat16 > $OUT/profile_msar_saved_bf16.txt 2>&1; echo "profile msar saved+bf16 rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p" $OUT/profile_msar_saved_bf16.txt | cut -c1-160; grep -E "depth_attention" $OUT/profile_msar_saved_bf16.txt | head -12 | cut -c1-160
S=$(date +%s)
timeout 120 python3 experiments/profile_step.py configs/msar.py:size=base --steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto --set model.save_read_outputs=true > $OUT/profile_msar_saved.txt 2>&1; echo "profile msar saved rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p" $OUT/profile_msar_saved.txt | cut -c1-160; grep -E "depth_attention" $OUT/profile_msar_saved.txt | head -4 | cut -c1-160
