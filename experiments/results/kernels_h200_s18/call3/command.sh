#!/bin/bash
# Session 18, call 3: phase 1's Mosaic mixing pass with 16-channel chunks (2 programs per SM) and 2-4 slots against 32 and Triton at base; the base step with the fastest float32-state variant.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=$(date +%s)
timeout 220 python3 experiments/mgpu/time_phase1_mix.py --bf16 --base-only > $OUT/time_phase1_mix.txt 2>&1; echo "time_phase1_mix rc=$? $(( $(date +%s)-S ))s"; grep -E "^##|ms |fit" $OUT/time_phase1_mix.txt | cut -c1-200
BEST=$(python3 - <<'PY'
import re
best = None
section = None
for line in open("/dev/stdin" if False else __import__("os").environ["OUT"] + "/time_phase1_mix.txt"):
    if line.startswith("## "):
        section = "float32" if "float32 state" in line else "other"
    m = re.match(r"mosaic bd=(\d+) n_slots=(\d+)\s+([\d.]+) ms", line)
    if m and section == "float32":
        ms = float(m.group(3))
        if best is None or ms < best[0]:
            best = (ms, m.group(1), m.group(2))
print(f"{best[1]} {best[2]}" if best else "32 2")
PY
)
set -- $BEST; echo "profiling with block_d=$1 n_slots=$2"
S=$(date +%s)
timeout 200 python3 -c "
import runpy, sys
from pallas_kernels.depth_attention import mosaic_gpu
mosaic_gpu.MIX_BLOCK_D_CHOICES = ($1,); mosaic_gpu.MIX_SLOTS = $2
sys.argv = ['experiments/profile_step.py', 'configs/msar.py:size=base', '--steps', '2', '--warmup', '1', '--top', '40', '--set', 'model.residual.implementation=auto', '--set', 'model.residual.gpu_kernels=mosaic']
runpy.run_path('experiments/profile_step.py', run_name='__main__')
" > $OUT/profile_msar_mix_bd$1_slots$2.txt 2>&1; echo "profile rc=$? $(( $(date +%s)-S ))s"; sed -n "4,6p;30,46p" $OUT/profile_msar_mix_bd$1_slots$2.txt | cut -c1-150
