#!/bin/bash
# Session 26, call 1: AttnRes's reads (one stream) through the Mosaic GPU kernels against Triton's (the default for one stream): the per-sublayer bench, phase 1's passes alone, the base step both ways, a GPU test.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for G in auto mosaic; do
  S=$(date +%s); mkdir -p $OUT/bench_$G
  OUT=$OUT/bench_$G timeout 200 python3 -m pallas_kernels.depth_attention.bench --backward pallas --configs attnres --gpu_kernels $G > $OUT/bench_$G/bench.txt 2>&1; echo "bench $G rc=$? $(( $(date +%s)-S ))s"; grep -E "fwd|parts" $OUT/bench_$G/bench.txt | grep -v '^{' | cut -c1-400
done
cd experiments/mgpu
for P in mix scores; do
  S=$(date +%s)
  timeout 150 python3 time_phase1_$P.py --attnres > $OUT/time_$P.txt 2>&1; echo "time $P rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms|FAIL" $OUT/time_$P.txt | cut -c1-200
done
cd ../..
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 160 python3 -m pytest -v -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_single_stream.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|Error|passed|failed" $OUT/gpu_tests.txt | cut -c1-300 | tail -8
for G in auto mosaic; do
  S=$(date +%s)
  timeout 130 python3 experiments/profile_step.py configs/attnres.py:size=base --steps 2 --warmup 1 --top 20 --set model.residual.implementation=auto --set model.residual.gpu_kernels=$G > $OUT/profile_attnres_$G.txt 2>&1; echo "profile attnres $G rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p" $OUT/profile_attnres_$G.txt | cut -c1-160; grep -E "depth_attention" $OUT/profile_attnres_$G.txt | head -12 | cut -c1-160
done
