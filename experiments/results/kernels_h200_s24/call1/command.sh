#!/bin/bash
# Session 24, call 1: phase 2's backward input kernel walking 1, 2, 4 and 8 batch rows per program (INPUTS_ROWS_PER_PROGRAM, default 4) timed at base; its GPU tests against Triton; the MSAR base step with the default (4 rows), Vanilla re-timed; the MSAR step with save_read_outputs and a bf16 state (not the defaults) at today's kernels.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
MOSAIC_GPU_DUMP_PTXAS=1 timeout 150 python3 experiments/mgpu/time_phase2.py --backward --rows --base-only > $OUT/time_inputs_rows.txt 2>&1; echo "inputs rows rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|relative|Error" $OUT/time_inputs_rows.txt | cut -c1-250; grep -iE "spill|registers" $OUT/time_inputs_rows.txt | cut -c1-120 | sort | uniq -c
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 120 python3 -m pytest -v -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_inputs.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|Error|passed|failed" $OUT/gpu_tests.txt | cut -c1-200 | tail -9
S=$(date +%s)
timeout 120 python3 experiments/profile_step.py configs/msar.py:size=base --steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto --json $OUT/profile_msar.json > $OUT/profile_msar.txt 2>&1; echo "profile msar rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p" $OUT/profile_msar.txt | cut -c1-160; grep -E "depth_attention" $OUT/profile_msar.txt | head -12 | cut -c1-160
S=$(date +%s)
timeout 60 python3 experiments/profile_step.py configs/vanilla.py:size=base --steps 2 --warmup 1 --top 5 > $OUT/profile_vanilla.txt 2>&1; echo "profile vanilla rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p" $OUT/profile_vanilla.txt | cut -c1-160
S=$(date +%s)
timeout 120 python3 experiments/profile_step.py configs/msar.py:size=base --steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto --set model.save_read_outputs=true --set model.residual.state_dtype=bfloat16 > $OUT/profile_msar_saved_bf16.txt 2>&1; echo "profile msar saved+bf16 rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p" $OUT/profile_msar_saved_bf16.txt | cut -c1-160
