#!/bin/bash
# Session 25, call 3: Nsight Compute source counters (warp-state samples per SASS instruction) for phase 1's scoring and mixing passes and phase 2's backward input kernel at base.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
S=$(date +%s)
timeout 200 ncu --clock-control none -k regex:mosaic_gpu --launch-count 2 --section SourceCounters --section WarpStateStats -o $OUT/phase1 python3 experiments/mgpu/ncu_phase1.py > $OUT/ncu_phase1.txt 2>&1; echo "ncu phase1 rc=$? $(( $(date +%s)-S ))s"; tail -3 $OUT/ncu_phase1.txt | cut -c1-200
S=$(date +%s)
timeout 200 ncu --clock-control none -k regex:mosaic_gpu --launch-skip 2 --launch-count 1 --section SourceCounters --section WarpStateStats -o $OUT/inputs python3 experiments/mgpu/ncu_phase2.py > $OUT/ncu_phase2.txt 2>&1; echo "ncu phase2 rc=$? $(( $(date +%s)-S ))s"; tail -3 $OUT/ncu_phase2.txt | cut -c1-200
for r in phase1 inputs; do
  timeout 120 ncu -i $OUT/$r.ncu-rep --page source --csv --print-source sass > $OUT/${r}_sass.csv 2>&1; echo "$r sass rc=$? $(wc -c < $OUT/${r}_sass.csv) bytes"
  timeout 60 ncu -i $OUT/$r.ncu-rep --page details > $OUT/${r}_details.txt 2>&1
  head -c 600 $OUT/${r}_sass.csv; echo
done
gzip -f $OUT/*_sass.csv; ls -la $OUT
