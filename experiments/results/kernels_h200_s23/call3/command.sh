#!/bin/bash
# Session 23, call 3: the per-sublayer main table with the Mosaic transpose under auto; Nsight Compute on phase 1's six Mosaic kernels at base (throughput, occupancy, stall reasons); the SASS of phase 2's three Mosaic kernels (MOSAIC_GPU_DUMP_SASS).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 ncu --clock-control none -k regex:mosaic_gpu --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' python3 experiments/mgpu/ncu_phase1.py > $OUT/ncu_phase1.txt 2>&1; echo "ncu phase1 rc=$? $(( $(date +%s)-S ))s"; grep -E "^  body_mosaic|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|One or More Eligible|Grid Size|==ERROR==" $OUT/ncu_phase1.txt | head -70 | cut -c1-120
S=$(date +%s)
mkdir -p $OUT/sass
MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_TO=$OUT/sass timeout 120 python3 experiments/mgpu/ncu_phase2.py > $OUT/sass_phase2.txt 2>&1; echo "sass rc=$? $(( $(date +%s)-S ))s"; ls -la $OUT/sass | head; tail -3 $OUT/sass_phase2.txt | cut -c1-200
S=$(date +%s)
timeout 200 python3 -m pallas_kernels.depth_attention.bench --backward pallas > $OUT/bench.txt 2>&1; echo "bench rc=$? $(( $(date +%s)-S ))s"; grep -E "MSAR|AttnRes|bandwidth" $OUT/bench.txt | head -12 | cut -c1-200
