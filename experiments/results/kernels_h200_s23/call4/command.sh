#!/bin/bash
# Session 23, call 4: phase 2's backward input kernel loading each lag and per-token row once per tile (INPUTS_REUSE_LOADS), two and three warpgroups, against the default (timed at base, ptxas); its GPU tests against Triton; the MSAR base step with the option if it is faster.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
MOSAIC_GPU_DUMP_PTXAS=1 timeout 100 python3 experiments/mgpu/time_phase2.py --backward --inputs --reuse --base-only > $OUT/time_inputs_reuse.txt 2>&1; echo "inputs reuse rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|relative|Error" $OUT/time_inputs_reuse.txt | cut -c1-250; grep -iE "spill|registers" $OUT/time_inputs_reuse.txt | cut -c1-120 | sort | uniq -c
PICK=$(python3 -c "
import re
t = {m.group(1): float(m.group(2)) for m in re.finditer(r'pass 3 (mosaic [^:]+): ([0-9.]+) ms', open('$OUT/time_inputs_reuse.txt').read())}
best = min(t, key=t.get)
print(best.split(' wg')[0].split()[-1], 'True' if best.endswith('reuse') else 'False')" 2>/dev/null || echo "2 False"); echo "fastest (warpgroups, reuse): $PICK"
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 110 python3 -m pytest -v -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_inputs.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|Error|passed|failed" $OUT/gpu_tests.txt | cut -c1-200 | tail -6
set -- $PICK
if [ "$2" = "True" ] || [ "$1" != "2" ]; then
S=$(date +%s)
SET="import sys, runpy; from pallas_kernels.depth_attention import mosaic_gpu; mosaic_gpu.INPUTS_WARPGROUPS = $1; mosaic_gpu.INPUTS_REUSE_LOADS = $2"
timeout 110 python3 -c "$SET; sys.argv = ['experiments/profile_step.py', 'configs/msar.py:size=base', '--steps', '2', '--warmup', '1', '--top', '40', '--set', 'model.residual.implementation=auto']; runpy.run_path('experiments/profile_step.py', run_name='__main__')" > $OUT/profile_msar.txt 2>&1; echo "profile msar ($PICK) rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p" $OUT/profile_msar.txt | cut -c1-160; grep -E "depth_attention" $OUT/profile_msar.txt | head -9 | cut -c1-160
fi
