"""Compile the TPU depth-attention kernels for a TPU v5p ahead of time, on a CPU machine.

Needs libtpu (not a project dependency)::

    pip install --target /tmp/libtpu libtpu==0.0.48.1
    PYTHONPATH=/tmp/libtpu python benchmarks/tpu_kernels_aot.py

Prints ``ok`` or the compiler's error for each of 55 compiles (5 mechanism cases x 11 forward and
backward variants) and exits 1 if any fails. The variants: docs/parallelism.md section 7.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from pallas_kernels.depth_attention import api, reference  # noqa: E402

topo = topologies.get_topology_desc("v5p:2x2x1", platform="tpu")
mesh = jax.sharding.Mesh([topo.devices[0]], ("x",))
rep = NamedSharding(mesh, P())
failures = 0


def sds(shape, dt=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dt, sharding=rep)


def comp(name, fn, *args):
    global failures
    t0 = time.time()
    try:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            low = jax.jit(fn).trace(*args).lower()
        low.compile()
        print(f"    {name}: ok ({time.time() - t0:.1f} s)")
    except Exception as e:  # noqa: BLE001 - report every case
        failures += 1
        print(f"    {name}: FAIL {type(e).__name__}: {str(e)[:700]}")


def run(kernels, heads, segments, fuse, t_len=64, d=256, with_valid=False):
    """``with_valid``: phase 1 gets a source mask, as the model's always does (the kernels skip
    invalid sources, reading the mask from scalar memory on the TPU)."""
    n, batch, n_targets, m, k = 3, 2, 2, len(kernels), sum(kernels)
    print(f"{topo.devices[0].device_kind}: kernels={kernels} heads={heads} segments={segments} fusion={fuse} "
          f"source mask={with_valid}")
    seg = sds((batch, t_len), jnp.int32) if segments else None
    valid = sds((n,), jnp.bool_) if with_valid else None
    kw = dict(stream_kernels=kernels, heads=heads, implementation="pallas_tpu", interpret=False)
    kw_pallas = dict(kw, backward="pallas")
    banks = sds((n, k, d)) if k else None

    def loss1(x, b, q, v, sg, kw=kw):
        st = api.phase1(x, b, q, v, segment_ids=sg, **kw)
        return jnp.sum(st.acc) + jnp.sum(st.denom)

    args1 = (sds((n, batch, t_len, d)), banks, sds((n_targets, m, d)), valid, seg)
    comp("phase 1 forward", lambda x, b, q, v, sg: api.phase1(x, b, q, v, segment_ids=sg, **kw), *args1)
    comp("phase 1 forward+backward (XLA backward)", jax.grad(loss1, argnums=(0, 2)), *args1)
    comp("phase 1 forward+backward (Pallas backward, wide form)",
         jax.grad(lambda *a: loss1(*a, kw=kw_pallas), argnums=(0, 2)), *args1)
    comp("phase 1 forward+backward (Pallas backward, reverse-T form)",
         jax.grad(lambda *a: loss1(*a, kw=dict(kw_pallas, phase1_backward_form="reverse_t")), argnums=(0, 2)),
         *args1)
    comp("phase 1 forward+backward (hybrid backward)",
         jax.grad(lambda *a: loss1(*a, kw=dict(kw, backward="hybrid")), argnums=(0, 2)), *args1)

    def loss1_per_target(x, b, q, v, sg):  # one state per target: the kernels' separate outputs and inputs
        states = api.phase1(x, b, q, v, segment_ids=sg, per_target=True, **kw_pallas)
        return sum(jnp.sum(st.acc) + jnp.sum(st.denom) for st in states)

    comp("phase 1 forward+backward per target (Pallas backward)", jax.grad(loss1_per_target, argnums=(0, 2)),
         *args1)
    state = reference.SoftmaxState(sds((m, batch, t_len, heads)), sds((m, batch, t_len, heads)),
                                   sds((m, batch, t_len, d)))
    gate = (sds((m * d, m)), sds(()), sds((m,))) if fuse == "gate" else None
    bank = sds((k, d)) if k else None

    def fwd2(st, x, b, q, g, sg, kw=kw):
        return api.phase2_fused(st, x, b, q, True, g, segment_ids=sg, **kw)

    args2 = (state, sds((batch, t_len, d)), bank, sds((m, d)), gate, seg)
    comp("phase 2 forward", fwd2, *args2)
    comp("phase 2 forward+backward (XLA backward)",
         jax.grad(lambda *a: jnp.sum(fwd2(*a)), argnums=(0, 1, 3)), *args2)
    comp("phase 2 forward+backward (Pallas backward)",
         jax.grad(lambda *a: jnp.sum(fwd2(*a, kw=kw_pallas)), argnums=(0, 1, 3)), *args2)
    comp("phase 2 forward+backward (Pallas backward, wide form)",
         jax.grad(lambda *a: jnp.sum(fwd2(*a, kw=dict(kw_pallas, phase2_backward_form="wide"))), argnums=(0, 1, 3)),
         *args2)

    def block_read_bf16_state(x, b, q, v, x2, b2, q2, g, sg):  # phase 1 -> phase 2 + fusion, bf16 acc
        states = api.phase1(x, b, q, v, segment_ids=sg, per_target=True, state_dtype="bfloat16", **kw_pallas)
        return sum(jnp.sum(fwd2(st, x2, b2, q2, g, sg, kw=kw_pallas)) for st in states)

    comp("phase 1 + phase 2 forward+backward, bf16 state (Pallas backward)",
         jax.grad(block_read_bf16_state, argnums=(0, 2, 4, 6)), *args1[:4], *args2[1:5], seg)


run((0, 4, 8, 12), 1, True, "gate", with_valid=True)
run((0, 4, 8, 12), 1, False, "gate")
run((0,), 1, False, "mean", with_valid=True)
run((0,), 2, True, "mean")
run((0, 0, 0), 2, False, "gate")
print(f"{failures} failure(s)")
sys.exit(1 if failures else 0)
