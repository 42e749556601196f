#!/bin/bash
# Session 44, call 3: call 2's census of phase 2's kernels at the issue's shape (its CSV did not
# come back: too many files), then phase 1's kernels at the issue's shape with the variants
# (ncu_phase1.py --variants: dstreams with per-chunk windows, the mix with per-item windows and
# with the p rows for stream 0 only) to see whether the DRAM bytes the census found over the
# design's hold those kernels. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name --format=csv,noheader
M=$(python3 experiments/mgpu/ncu_census.py --metrics)
S=$(date +%s)
for p in 2 1; do
  extra=$([ $p = 1 ] && echo --variants)
  timeout 200 ncu --clock-control none -k regex:mosaic --csv --print-units base --metrics $M \
      python3 experiments/mgpu/ncu_phase$p.py --issue $extra > $OUT/ncu_p${p}_issue.csv 2>> $OUT/ncu.err
  echo "ncu phase $p rc $? $(( $(date +%s)-S ))s"
done
python3 -c "from pallas_kernels.depth_attention import bench; print(f'{bench.copy_bandwidth() / 1e12:.4f}')" \
    > $OUT/copy.txt
C=$(cat $OUT/copy.txt); echo "copy $C TB/s"
python3 experiments/mgpu/ncu_census.py $OUT/ncu_p1_issue.csv $OUT/ncu_p2_issue.csv --copy-tbps $C | tee $OUT/census.txt
