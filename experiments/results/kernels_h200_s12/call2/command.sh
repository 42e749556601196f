#!/bin/bash
# Session 12, call 2: A/B of the gate W layout in the two _dz kernels (B: strided [m, d, m] there), same machine.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
P="--steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto"
F=pallas_kernels/depth_attention/fused_bwd_phase2.py
cp $F /tmp/A.py
for V in B A; do
  if [ $V = B ]; then cp gpu_jobs/fused_bwd_phase2_B.py $F; else cp /tmp/A.py $F; fi
  S=$(date +%s)
  timeout 130 python3 experiments/profile_step.py configs/msar.py:size=base $P --json $OUT/profile_msar_$V.json > $OUT/profile_msar_$V.txt 2>&1; echo "msar $V rc=$? $(( $(date +%s)-S ))s"; grep -E "median|memory" $OUT/profile_msar_$V.txt
  grep -A12 "Pallas kernel" $OUT/profile_msar_$V.txt
done
cp gpu_jobs/fused_bwd_phase2_B.py $F
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_fused_bwd_phase2.py -p no:cacheprovider > $OUT/gpu_tests_B.txt 2>&1; echo "gpu tests B rc=$? $(( $(date +%s)-S ))s"; tail -3 $OUT/gpu_tests_B.txt
cp /tmp/A.py $F
