#!/bin/bash
# Session 26, call 2: the scoring pass for one stream with its sums deferred (timed, GPU tests); AttnRes with "auto" taking phase 1's scoring pass, gdots and dstreams in Mosaic for one stream: base step, Vanilla, per-sublayer bench (float32 and bf16 state), base step with a bf16 state + saved read outputs. Most wanted first.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 240 python3 -m pytest -v -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_single_stream.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|Error|passed|failed" $OUT/gpu_tests.txt | cut -c1-300 | tail -8
S=$(date +%s)
(cd experiments/mgpu && timeout 150 python3 time_phase1_scores.py --attnres > $OUT/time_scores.txt 2>&1); echo "time scores rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms|FAIL" $OUT/time_scores.txt | cut -c1-200
S=$(date +%s)
timeout 130 python3 experiments/profile_step.py configs/attnres.py:size=base --steps 2 --warmup 1 --top 60 --json $OUT/profile_attnres.json --set model.residual.implementation=auto > $OUT/profile_attnres.txt 2>&1; echo "profile attnres rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p" $OUT/profile_attnres.txt | cut -c1-160; grep -E "depth_attention" $OUT/profile_attnres.txt | head -12 | cut -c1-160
S=$(date +%s)
timeout 120 python3 experiments/profile_step.py configs/vanilla.py:size=base --steps 2 --warmup 1 --top 10 > $OUT/profile_vanilla.txt 2>&1; echo "profile vanilla rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p" $OUT/profile_vanilla.txt | cut -c1-160
for ST in float32 bfloat16; do
  S=$(date +%s); mkdir -p $OUT/bench_$ST
  OUT=$OUT/bench_$ST timeout 200 python3 -m pallas_kernels.depth_attention.bench --backward pallas --configs attnres --state_dtype $ST > $OUT/bench_$ST/bench.txt 2>&1; echo "bench $ST rc=$? $(( $(date +%s)-S ))s"; grep -E "fwd|parts" $OUT/bench_$ST/bench.txt | grep -v '^{' | cut -c1-400
  if [ $ST = float32 ]; then
    S=$(date +%s)
    timeout 130 python3 experiments/profile_step.py configs/attnres.py:size=base --steps 2 --warmup 1 --top 20 --set model.residual.implementation=auto --set model.residual.state_dtype=bfloat16 --set model.save_read_outputs=true > $OUT/profile_attnres_bf16_saved.txt 2>&1; echo "profile attnres bf16+saved rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p" $OUT/profile_attnres_bf16_saved.txt | cut -c1-160; grep -E "depth_attention" $OUT/profile_attnres_bf16_saved.txt | head -12 | cut -c1-160
  fi
done
