#!/bin/bash
# Session 13, call 3: GPU tests (saved reads, fixed; the scoring kernel's matrix-product form);
# the scoring kernel alone in both forms at `base`; base MSAR (save_read_outputs) A/B of the forms.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
P="--steps 2 --warmup 1 --top 40 --set model.residual.implementation=auto --set model.save_read_outputs=true"
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" tests/test_model_kernel_path.py tests/kernels/test_depth_attention_fused.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; grep -E "^E.*(Counter|rel|Error)|passed|failed" $OUT/gpu_tests.txt | tail -5
S=$(date +%s)
timeout 90 python3 -m pallas_kernels.depth_attention.bench --scores_forms --sweeps_only --base_shape > $OUT/bench_scores.txt 2>&1; echo "bench rc=$? $(( $(date +%s)-S ))s"; grep phase $OUT/bench_scores.txt | cut -c1-400
run() { local name=$1 lim=$2; S=$(date +%s)
  timeout $lim python3 experiments/profile_step.py configs/msar.py:size=base $P --json $OUT/profile_$name.json > $OUT/profile_$name.txt 2>&1
  echo "$name rc=$? $(( $(date +%s)-S ))s"; grep -E "median|memory" $OUT/profile_$name.txt; grep -E "depth_attention_scores|mix_acc" $OUT/profile_$name.txt | head -2; }
run msar_save_dot 110
sed -i 's/^DOT_QUERIES_MIN_TARGETS = 2$/DOT_QUERIES_MIN_TARGETS = 99/' pallas_kernels/depth_attention/fused.py; grep -n "^DOT_QUERIES_MIN_TARGETS" pallas_kernels/depth_attention/fused.py
run msar_save_per_target 110
rm -f $OUT/bench_log.jsonl
