#!/bin/bash
# Session 26, call 3: MHAR (one stream, 8 channel heads) through the Mosaic kernels against Triton's (what "auto" takes for several heads): GPU test with 1 and 8 heads, the base step both ways.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
JAX_PLATFORMS=cuda timeout 200 python3 -m pytest -v -p no:cacheprovider -m gpu -o addopts="" tests/kernels/test_mosaic_gpu_single_stream.py -k reads > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-S ))s"; grep -E "PASS|FAIL|Error|passed|failed" $OUT/gpu_tests.txt | cut -c1-300 | tail -8
for G in auto mosaic; do
  S=$(date +%s)
  timeout 130 python3 experiments/profile_step.py configs/mhar.py:size=base --steps 2 --warmup 1 --top 20 --set model.residual.implementation=auto --set model.residual.gpu_kernels=$G > $OUT/profile_mhar_$G.txt 2>&1; echo "profile mhar $G rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p" $OUT/profile_mhar_$G.txt | cut -c1-160; grep -E "depth_" $OUT/profile_mhar_$G.txt | head -20 | cut -c1-160
done
