#!/bin/bash
# Session 25, call 1: Nsight Compute on phase 1's six Mosaic kernels at base (each called alone); the per-sublayer bench with the float32 and the bf16 state.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 ncu --clock-control none -k regex:mosaic_gpu --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis_Tables --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' python3 experiments/mgpu/ncu_phase1.py > $OUT/ncu_phase1.txt 2>&1; echo "ncu rc=$? $(( $(date +%s)-S ))s"; grep -E "^[0-9] |Duration|DRAM Throughput|Issue Slots Busy|Achieved Occupancy|Registers Per|Theoretical Occ|No Eligible|Error|rror" $OUT/ncu_phase1.txt | cut -c1-150 | head -60
S=$(date +%s)
timeout 170 python3 -m pallas_kernels.depth_attention.bench --backward pallas > $OUT/bench.txt 2>&1; echo "bench f32 rc=$? $(( $(date +%s)-S ))s"; grep -E "fwd|copy bandwidth" $OUT/bench.txt | cut -c1-170
S=$(date +%s)
mkdir -p $OUT/bf16; OUT=$OUT/bf16 timeout 170 python3 -m pallas_kernels.depth_attention.bench --backward pallas --state_dtype bfloat16 > $OUT/bench_bf16.txt 2>&1; echo "bench bf16 rc=$? $(( $(date +%s)-S ))s"; grep -E "fwd|copy bandwidth" $OUT/bench_bf16.txt | cut -c1-170
