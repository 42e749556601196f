#!/bin/bash
# Session 44, call 2: the census of what bounds each Mosaic kernel (experiments/mgpu/ncu_census.py):
# Nsight Compute's instructions per scheduler, clock and DRAM bytes for phase 1's six kernels and
# phase 2's three, at the issue's shape and at `base`, then the issue and DRAM floors per kernel and
# per sublayer against the copy bandwidth measured in the same call. Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
ncu --version | tail -1
M=$(python3 experiments/mgpu/ncu_census.py --metrics)
S=$(date +%s)
for shape in issue base; do
  flag=$([ $shape = issue ] && echo --issue)
  for p in 1 2; do
    timeout 140 ncu --clock-control none -k regex:mosaic --csv --print-units base --metrics $M \
        python3 experiments/mgpu/ncu_phase$p.py $flag > $OUT/ncu_p${p}_$shape.csv 2> $OUT/ncu_p${p}_$shape.err
    echo "ncu phase $p $shape rc $? $(( $(date +%s)-S ))s"
  done
done
python3 - <<'PY' > $OUT/copy.txt
from pallas_kernels.depth_attention import bench
print(f"{bench.copy_bandwidth() / 1e12:.4f}")
PY
C=$(cat $OUT/copy.txt); echo "copy $C TB/s"
for shape in issue base; do
  echo "== $shape"
  python3 experiments/mgpu/ncu_census.py $OUT/ncu_p1_$shape.csv $OUT/ncu_p2_$shape.csv --copy-tbps $C \
      --skip 'mix#2' --per-sublayer 8 | tee $OUT/census_$shape.txt
done
