"""``benchmarks/mgpu/l2_hints.py``: L2 eviction hints added to the Mosaic GPU kernels' TMA copies
while they are lowered (checked in the lowered module's text, which carries the kernel's code),
only to the copies a rule names, and nothing left patched afterwards; ``time_l2_hints.py``'s
interpret-mode smoke run gives the same bits with and without hints."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "mgpu"))
import l2_hints  # noqa: E402
import time_l2_hints  # noqa: E402
from jax.experimental.mosaic.gpu import launch_context  # noqa: E402

from pallas_kernels.depth_attention import mosaic_gpu, mosaic_gpu_bwd1  # noqa: E402

KERNELS = (0, 4, 8, 12)


def _lowered_mix_text():
    n, b, t, d, s = 3, 1, 64, 64, 2
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (n, b, t, d), jnp.bfloat16)
    banks = jax.random.normal(k[1], (n, sum(KERNELS), d), jnp.float32)
    p = jax.random.uniform(k[2], (s, n, len(KERNELS), b, t, 1))
    fn = jax.jit(lambda *a: mosaic_gpu.phase1_mix(*a, None, None, stream_kernels=KERNELS, heads=1, per_target=True))
    mosaic_gpu._mix_kernel.cache_clear()
    jax.clear_caches()
    return fn.trace(x, banks, p).lower(lowering_platforms=("cuda",)).as_text()


def test_hints_go_on_the_copies_a_rule_names_and_nowhere_else():
    real = (launch_context.LaunchContext.async_copy, launch_context.nvvm.cp_async_bulk_tensor_shared_cluster_global,
            launch_context.nvvm.cp_async_bulk_tensor_global_shared_cta)
    plain = _lowered_mix_text()
    assert "createpolicy" not in plain
    with l2_hints.hinted({"stores": "evict_first", "f32_rank5_loads": "evict_last"}):
        hinted = _lowered_mix_text()
    # the mix stores its states (evict_first) and loads its p rows (rank 5, evict_last); its
    # windows (bf16) and taps (small float32) get none
    assert "createpolicy.fractional.L2::evict_first.b64" in hinted
    assert "createpolicy.fractional.L2::evict_last.b64" in hinted
    with l2_hints.hinted({"bf16_loads": "evict_normal"}):
        windows = _lowered_mix_text()
    assert "L2::evict_normal" in windows and "L2::evict_first" not in windows and "L2::evict_last" not in windows
    with l2_hints.hinted({"large_f32_loads": "evict_first"}):  # nothing that large at this shape
        assert "createpolicy" not in _lowered_mix_text()
    assert (launch_context.LaunchContext.async_copy, launch_context.nvvm.cp_async_bulk_tensor_shared_cluster_global,
            launch_context.nvvm.cp_async_bulk_tensor_global_shared_cta) == real
    assert "createpolicy" not in _lowered_mix_text()  # the patch is gone


def test_bad_rules_and_sets_raise():
    with pytest.raises(ValueError, match="rules are"):
        with l2_hints.hinted({"loads": "evict_first"}):
            pass
    with pytest.raises(ValueError, match="policies"):
        with l2_hints.hinted({"stores": "evict_soon"}):
            pass
    assert time_l2_hints.parse_set("none") == {}
    assert time_l2_hints.parse_set("stores=evict_first,bf16_loads=evict_last") == {
        "stores": "evict_first", "bf16_loads": "evict_last"}
    with pytest.raises(SystemExit):
        time_l2_hints.parse_set("stores")


@pytest.mark.slow
def test_interpreted_script_gives_the_same_bits(capsys):
    time_l2_hints.main(["--interpret", "none", "stores=evict_first,large_f32_loads=evict_first"])
    out = capsys.readouterr().out
    assert out.count("same bits: True") == 6 and "same bits: False" not in out
    assert mosaic_gpu_bwd1._kernel.cache_info().currsize > 0
