#!/bin/bash
# Session 21 (2026-12-03), call 4: phase 2's backward with pass 3 (the reverse-T input kernel) in Triton and in Mosaic GPU at base and the issue's shape; the base step with the Mosaic input kernel (_backend.AUTO_INPUTS set in-process).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 150 python3 experiments/mgpu/time_phase2.py --backward --inputs > $OUT/time_phase2_bwd_inputs.txt 2>&1; echo "phase2 bwd inputs rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|relative|FAIL|Error" $OUT/time_phase2_bwd_inputs.txt | cut -c1-400
INPUTS="import sys, runpy; from pallas_kernels.depth_attention import _backend; _backend.AUTO_INPUTS = True"
S=$(date +%s)
timeout 200 python3 -c "$INPUTS; sys.argv = ['experiments/profile_step.py', 'configs/msar.py:size=base', '--steps', '2', '--warmup', '1', '--top', '40', '--set', 'model.residual.implementation=auto']; runpy.run_path('experiments/profile_step.py', run_name='__main__')" > $OUT/profile_msar_inputs.txt 2>&1; echo "profile rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p;30,42p" $OUT/profile_msar_inputs.txt | cut -c1-150
