#!/bin/bash
# Session 12, call 4: pass 3 (phase 2 backward inputs) with loop-invariant rows hoisted out of its T loop. H0: none (control), H1: W, H2: W + bank.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
P="--steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto"
F=pallas_kernels/depth_attention/fused_bwd_phase2.py
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 100 python3 -m pytest -q -m gpu tests/kernels/test_fused_bwd_phase2.py -p no:cacheprovider > $OUT/gpu_tests_H2.txt 2>&1; echo "gpu tests H2 rc=$? $(( $(date +%s)-S ))s"; tail -2 $OUT/gpu_tests_H2.txt
for V in H2 H0 H1; do
  cp gpu_jobs/fbp2_$V.py $F
  S=$(date +%s)
  timeout 120 python3 experiments/profile_step.py configs/msar.py:size=base $P --json $OUT/profile_msar_$V.json > $OUT/profile_msar_$V.txt 2>&1; echo "msar $V rc=$? $(( $(date +%s)-S ))s"; grep -E "median" $OUT/profile_msar_$V.txt
  grep -E "phase2_bwd|scores" $OUT/profile_msar_$V.txt | head -4
done
