#!/bin/bash
# Session 44, call 5: phase 2's forward with the gate's statistics in their own pass (the default)
# and summed in the scoring pass ("in_scores", one expansion of the partial fewer; slower in
# session 19), timed (time_phase2.py --gate-stats --msar-only, both shapes) and counted at the
# issue's shape (ncu_phase2.py --issue --gate-stats ...). Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
S=$(date +%s)
timeout 240 python experiments/mgpu/time_phase2.py --gate-stats --msar-only 2>&1 | grep -v Warning | tee $OUT/gate_stats.txt
echo "timing $(( $(date +%s)-S ))s"
M=$(python3 experiments/mgpu/ncu_census.py --metrics)
for g in own_pass in_scores; do
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 ncu --clock-control none -k regex:phase2_mosaic --csv \
      --print-units base --metrics $M python3 experiments/mgpu/ncu_phase2.py --issue --gate-stats $g \
      > $OUT/ncu_p2_$g.csv 2>> $OUT/ncu.err
  echo "ncu $g rc $? $(( $(date +%s)-S ))s"
done
C=$(python3 -c "from pallas_kernels.depth_attention import bench; print(f'{bench.copy_bandwidth() / 1e12:.4f}')")
for g in own_pass in_scores; do echo "== $g"; python3 experiments/mgpu/ncu_census.py $OUT/ncu_p2_$g.csv --copy-tbps $C; done \
    | tee $OUT/census.txt
