"""The Mosaic GPU prototype of phase 2's scoring pass (``benchmarks/mgpu/scores_mgpu.py``,
1.55-1.70x faster than the Triton kernel on the H200; docs/kernels.md) in Pallas' Mosaic GPU
interpret mode, against the package's plain-jnp expansion (``reference.expand``): both ways of
bringing a lag's rows to the registers, several token tiles and channel chunks (so the
double-buffered pipeline's slots both turn over), random non-zero taps and queries. The GPU
path (TMA's zero fill instead of the padded rows; the ``"offset"`` form is wrong there) was
checked on the H200 by ``benchmarks/mgpu/time_scores.py``'s error column. In the slow suite
(CI runs it): a prototype outside the package, about 10 s."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.depth_attention import reference

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "mgpu"))
plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")


@pytest.mark.slow
@pytest.mark.parametrize("windows", ["tma", "offset"])
def test_interpreted_scores_match_the_expansion(windows):
    from scores_mgpu import scores_mgpu

    kernels, batch, t_len, d = (0, 4, 8, 12), 2, 128, 192  # 2 token tiles of 64, 3 chunks of 64
    keys = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(keys[0], (batch, t_len, d), jnp.bfloat16)
    bank = 0.3 * jax.random.normal(keys[1], (sum(kernels), d), jnp.float32)
    q = jax.random.normal(keys[2], (len(kernels), d), jnp.float32)
    dots, sumsq = scores_mgpu(x, bank, q, kernels=kernels, bt=64, bd=64, windows=windows,
                              interpret=plgpu.InterpretGPUParams())
    e = reference.expand(x, bank, kernels)  # [m, B, T, d] float32
    want_dots = jnp.einsum("mbtd,md->mbt", e, q, precision="highest")
    want_sumsq = jnp.sum(e * e, axis=-1)
    for got, want in ((dots, want_dots), (sumsq, want_sumsq)):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * float(jnp.max(jnp.abs(want))))
