#!/bin/bash
# Session 21 (2026-12-03), call 9: phase 2's input kernel in Mosaic GPU with one and two warpgroups per program (the streams split between them), against Triton's pass; ptxas's register and spill report.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
MOSAIC_GPU_DUMP_PTXAS=1 timeout 200 python3 experiments/mgpu/time_phase2.py --backward --inputs > $OUT/time_phase2_bwd_inputs_wg.txt 2>&1; echo "rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|relative|FAIL|Error|spill|registers" $OUT/time_phase2_bwd_inputs_wg.txt | cut -c1-300
