#!/bin/bash
# Session 19, call 2: what a TMA copy costs (per copy or per byte: experiments/mgpu/tma_rate.py), then phase 2's two Mosaic kernels with the state's chunk as one 3D box instead of one copy per stream (forward against the reference, backward per_stream against one), and the base step with it.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv > $OUT/nvidia_smi.txt 2>&1
S=$(date +%s)
timeout 80 python3 experiments/mgpu/tma_rate.py > $OUT/tma_rate.txt 2>&1; echo "tma_rate rc=$? $(( $(date +%s)-S ))s"; cut -c1-120 $OUT/tma_rate.txt | tail -12
S=$(date +%s)
timeout 80 python3 experiments/mgpu/time_phase2.py --base-only --msar-only --state-boxes > $OUT/time_phase2.txt 2>&1; echo "time_phase2 rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms |FAIL" $OUT/time_phase2.txt | cut -c1-200
S=$(date +%s)
timeout 90 python3 experiments/mgpu/time_phase2.py --backward --base-only --state-boxes > $OUT/time_phase2_bwd.txt 2>&1; echo "time_phase2 bwd rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|relative|FAIL" $OUT/time_phase2_bwd.txt | cut -c1-300
S=$(date +%s)
timeout 150 python3 experiments/profile_step.py configs/msar.py:size=base --steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto > $OUT/profile_msar.txt 2>&1; echo "profile rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p;30,46p" $OUT/profile_msar.txt | cut -c1-150
