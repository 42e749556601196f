#!/bin/bash
# Session 23, call 1: the GPU test of the Mosaic transpose (mosaic_gpu_bwd1.sources_transpose against Triton's) and the other GPU tests of phase 1's Mosaic kernels; the transpose alone, timed (base); the MSAR base step with the Mosaic transpose under auto (with its per-op JSON and HLO); Nsight Compute on phase 2's three Mosaic kernels at base.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 200 python3 -m pytest -v -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_bwd1.py tests/kernels/test_mosaic_gpu_phase1.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|Error|passed|failed" $OUT/gpu_tests.txt | cut -c1-200 | tail -15
S=$(date +%s)
timeout 150 python3 experiments/mgpu/time_phase1_bwd.py --base-only > $OUT/time_phase1_bwd.txt 2>&1; echo "phase1 bwd rc=$? $(( $(date +%s)-S ))s"; grep -E "^#|ms |FAIL|Error" $OUT/time_phase1_bwd.txt | cut -c1-200
ON="import sys, runpy; from pallas_kernels.depth_attention import _backend; _backend.AUTO_TRANSPOSE = True"
S=$(date +%s)
timeout 150 python3 -c "$ON; sys.argv = ['experiments/profile_step.py', 'configs/msar.py:size=base', '--steps', '2', '--warmup', '1', '--top', '40', '--json', '$OUT/profile_msar.json', '--hlo_dir', '$OUT/hlo', '--set', 'model.residual.implementation=auto']; runpy.run_path('experiments/profile_step.py', run_name='__main__')" > $OUT/profile_msar_mosaic_transpose.txt 2>&1; echo "profile (Mosaic transpose) rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p" $OUT/profile_msar_mosaic_transpose.txt | cut -c1-160; grep -iE "transpose" $OUT/profile_msar_mosaic_transpose.txt | head -6 | cut -c1-160
S=$(date +%s)
(which ncu; ncu --version; ncu --list-sections) > $OUT/ncu_sections.txt 2>&1
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 ncu --clock-control none -k regex:mosaic_gpu --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis_Tables --section SchedulerStats --section ComputeWorkloadAnalysis python3 experiments/mgpu/ncu_phase2.py > $OUT/ncu_phase2.txt 2>&1; echo "ncu phase2 rc=$? $(( $(date +%s)-S ))s"; grep -E "Duration|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Memory Throughput|DRAM Throughput|Compute \(SM\)|==PROF==|==ERROR==" $OUT/ncu_phase2.txt | head -40 | cut -c1-160
