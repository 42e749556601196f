python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments/mgpu PYTHONUNBUFFERED=1
python -m pytest -q -m gpu tests/kernels/test_mosaic_gpu_phase1.py tests/kernels/test_mosaic_gpu_bwd1.py 2>&1 | tail -3 | tee $OUT/gpu_tests.txt
python experiments/mgpu/time_phase1_mix.py --direct 2>&1 | tee $OUT/mix_direct.txt
python experiments/mgpu/time_phase1_bwd.py --direct 2>&1 | tee $OUT/dstreams_direct.txt
# the fastest direct variant at the issue's shape, if it beats the staged default by 3%
BEST=$(python - <<'PY'
import os, re
rows = {}
shape = None
for line in open(os.environ["OUT"] + "/mix_direct.txt"):
    if line.startswith("## "):
        shape = line.split(":")[0][3:]
    m = re.match(r"mosaic bd=32 n_slots=(\d+) padded( stores direct)?\s+([\d.]+) ms", line)
    if m and shape == "issue":
        rows[(int(m.group(1)), bool(m.group(2)))] = float(m.group(3))
staged = rows.get((3, False))
direct = {k: v for k, v in rows.items() if k[1]}
if staged and direct:
    (slots, _), ms = min(direct.items(), key=lambda kv: kv[1])
    print(slots if ms < 0.97 * staged else "")
PY
)
echo "best direct slots: '$BEST'" | tee $OUT/choice.txt
if [ -n "$BEST" ]; then
  for form in staged direct; do
    python - "$form" "$BEST" <<'PY' 2>&1 | tee $OUT/bench_msar_$form.txt
import runpy, sys
from pallas_kernels.depth_attention import mosaic_gpu
if sys.argv[1] == "direct":
    mosaic_gpu.DEFAULT_MIX_STORES, mosaic_gpu.MIX_SLOTS = "direct", int(sys.argv[2])
print("mix:", mosaic_gpu.DEFAULT_MIX_STORES, mosaic_gpu.MIX_SLOTS, flush=True)
sys.argv = ["bench", "--backward", "pallas", "--configs", "msar"]
runpy.run_module("pallas_kernels.depth_attention.bench", run_name="__main__")
PY
  done
  python - "$BEST" <<'PY' 2>&1 | tee $OUT/step_msar_direct.txt
import sys
from pallas_kernels.depth_attention import mosaic_gpu
mosaic_gpu.DEFAULT_MIX_STORES, mosaic_gpu.MIX_SLOTS = "direct", int(sys.argv[1])
print("mix:", mosaic_gpu.DEFAULT_MIX_STORES, mosaic_gpu.MIX_SLOTS, flush=True)
sys.path.insert(0, "experiments")
import profile_step
profile_step.main(["configs/msar.py:size=base", "--steps", "2", "--warmup", "1", "--top", "12",
                   "--set", "model.residual.implementation=auto"])
PY
fi
