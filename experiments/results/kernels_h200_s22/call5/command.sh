#!/bin/bash
# Session 22, call 5: the expansion's transpose in Mosaic GPU (mosaic_gpu_bwd1.sources_transpose) against Triton's, with ptxas's report; phase 2's backward state kernel with its sums stored through its rows' buffer (two programs per SM) against its own buffer; the MSAR base step with both (and with the Triton transpose).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
MOSAIC_GPU_DUMP_PTXAS=1 timeout 150 python3 experiments/mgpu/time_phase1_bwd.py > $OUT/time_phase1_bwd.txt 2>&1; echo "phase1 bwd rc=$? $(( $(date +%s)-S ))s"; grep -E "^#|ms |FAIL" $OUT/time_phase1_bwd.txt | cut -c1-200; grep -iE "spill|registers" $OUT/time_phase1_bwd.txt | cut -c1-120 | uniq -c
S=$(date +%s)
timeout 120 python3 experiments/mgpu/time_phase2.py --backward --state-rows > $OUT/time_phase2_bwd.txt 2>&1; echo "phase2 bwd rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|relative|FAIL|Error" $OUT/time_phase2_bwd.txt | cut -c1-300
S=$(date +%s)
timeout 120 python3 experiments/profile_step.py configs/msar.py:size=base --steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto > $OUT/profile_msar.txt 2>&1; echo "profile rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p" $OUT/profile_msar.txt | cut -c1-160; grep -iE "mosaic|transpose" $OUT/profile_msar.txt | head -12 | cut -c1-160
NOT="import sys, runpy; from pallas_kernels.depth_attention import _backend; _backend.AUTO_TRANSPOSE = False"
S=$(date +%s)
timeout 120 python3 -c "$NOT; sys.argv = ['experiments/profile_step.py', 'configs/msar.py:size=base', '--steps', '2', '--warmup', '1', '--top', '40', '--set', 'model.residual.implementation=auto']; runpy.run_path('experiments/profile_step.py', run_name='__main__')" > $OUT/profile_msar_triton_transpose.txt 2>&1; echo "profile (Triton transpose) rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p" $OUT/profile_msar_triton_transpose.txt | cut -c1-160
