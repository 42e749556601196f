#!/bin/bash
# Session 42, call 1 (prepared in session 41 as its call 3, run with `--only slots`): phase 2's
# backward input kernel with three tiles in flight instead of two (mosaic_gpu.INPUTS_SLOTS), with and
# without bf16 widened in place, `base` and the issue's shape; then its GPU tests with three slots.
# Carry [".whl"].
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv
timeout 300 python experiments/mgpu/time_inner_loops.py --inputs-only --only slots 2>&1 | grep -v Warning | tee $OUT/inputs.txt
cat > /tmp/slots3.py <<'PY'
from pallas_kernels.depth_attention import mosaic_gpu
mosaic_gpu.INPUTS_SLOTS = 3
PY
JAX_PLATFORMS=cuda timeout 200 python -c "
import sys, runpy, pytest; exec(open('/tmp/slots3.py').read())
sys.exit(pytest.main(['-v', '-m', 'gpu', 'tests/kernels/test_mosaic_gpu_inputs.py', '-k', 'per_program', '-p', 'no:cacheprovider']))
" 2>&1 | grep -E "PASS|FAIL|passed|failed|rror" | tail -8 | tee $OUT/gpu_test_slots3.txt
