python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
env JAX_PLATFORMS=cuda timeout 240 python -m pytest -q -m gpu tests/kernels/test_mosaic_gpu_phase1.py tests/kernels/test_mosaic_gpu_bwd1.py 2>&1 | tail -4 | tee $OUT/gpu_tests.txt
python experiments/mgpu/time_target_split.py 2>&1 | tee $OUT/target_split.txt
