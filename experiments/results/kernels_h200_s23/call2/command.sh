#!/bin/bash
# Session 23, call 2: phase 2's backward input kernel with 1-4 warpgroups per program (timed, base; ptxas's registers and spills; GPU test against Triton for 2-4); the MSAR base step with the fastest count and the sources-first query-gradient operand; Vanilla's and AttnRes's base steps for the ratios; Nsight Compute's stall reasons for phase 2's kernels.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
MOSAIC_GPU_DUMP_PTXAS=1 timeout 240 python3 experiments/mgpu/time_phase2.py --backward --inputs --base-only --msar-only > $OUT/time_inputs_wg.txt 2>&1; echo "inputs wg rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|relative|Error" $OUT/time_inputs_wg.txt | cut -c1-250; grep -iE "spill|registers" $OUT/time_inputs_wg.txt | cut -c1-120 | sort | uniq -c
WG=$(python3 -c "
import re
best = min((float(m.group(2)), int(m.group(1))) for m in re.finditer(r'pass 3 mosaic (\d) wg: ([0-9.]+) ms', open('$OUT/time_inputs_wg.txt').read()))
print(best[1])" 2>/dev/null || echo 2); echo "fastest warpgroups: $WG"
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -v -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_inputs.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|Error|passed|failed" $OUT/gpu_tests.txt | cut -c1-200 | tail -6
SET="import sys, runpy; from pallas_kernels.depth_attention import mosaic_gpu; mosaic_gpu.INPUTS_WARPGROUPS = $WG"
S=$(date +%s)
timeout 150 python3 -c "$SET; sys.argv = ['experiments/profile_step.py', 'configs/msar.py:size=base', '--steps', '2', '--warmup', '1', '--top', '40', '--json', '$OUT/profile_msar.json', '--set', 'model.residual.implementation=auto']; runpy.run_path('experiments/profile_step.py', run_name='__main__')" > $OUT/profile_msar.txt 2>&1; echo "profile msar (wg $WG) rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p" $OUT/profile_msar.txt | cut -c1-160; grep -E "depth_attention|begin_block \| backward|depth_read \| backward" $OUT/profile_msar.txt | head -14 | cut -c1-160
S=$(date +%s)
timeout 120 python3 experiments/profile_step.py configs/vanilla.py:size=base --steps 2 --warmup 1 --top 10 > $OUT/profile_vanilla.txt 2>&1; echo "profile vanilla rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p" $OUT/profile_vanilla.txt | cut -c1-160
S=$(date +%s)
timeout 120 python3 experiments/profile_step.py configs/attnres.py:size=base --steps 2 --warmup 1 --top 10 --set model.residual.implementation=auto > $OUT/profile_attnres.txt 2>&1; echo "profile attnres rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p" $OUT/profile_attnres.txt | cut -c1-160
S=$(date +%s)
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 ncu --clock-control none -k regex:mosaic_gpu --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' python3 -c "$SET; import sys, runpy; sys.argv = ['x']; runpy.run_path('experiments/mgpu/ncu_phase2.py', run_name='__main__')" > $OUT/ncu_stalls.txt 2>&1; echo "ncu stalls rc=$? $(( $(date +%s)-S ))s"; grep -E "body_mosaic|stalled" $OUT/ncu_stalls.txt | awk '{print $1, $NF}' | cut -c1-120
