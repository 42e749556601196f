"""L2 eviction hints on the Mosaic GPU kernels' TMA copies, for timing experiments only.

Nsight Compute's census (``ncu_census.py``) finds phase 1's kernels reading 1.4-1.8x the design's bytes from DRAM: data
they fetch more than once (a chunk's lag windows once per stream, the mix's ``p`` rows once per
chunk) is evicted from L2 between the fetches by the data they stream once (``gdots``' and
``dstreams``' 4.3 GB of ``g_A`` at the bench shape, the mix's 4.3 GB of state stores). Hopper's
TMA copies take a 64-bit L2 cache policy (PTX ``createpolicy``; ``.L2::cache_hint`` on
``cp.async.bulk.tensor``): a copy marked ``evict_first`` leaves its lines as the first to go,
``evict_last`` as the last. Mosaic GPU (jax 0.11.2) passes no policy, so ``hinted(rules)`` wraps
``LaunchContext.async_copy`` while it is active: each TMA copy whose global side matches a rule
gets that rule's policy (the NVVM ops' ``l2_cache_hint`` operand). It changes only the code that
kernels lowered inside the ``with`` get, not their arithmetic: the outputs are the same bits.

Rules name what a copy moves, told apart by its global ref (all a copy sees):
``"stores"``, every shared -> global copy (the mix's states, ``dstreams``' stream cotangents);
``"large_f32_loads"``, loads from a float32 array of at least ``LARGE_BYTES`` (``mosaic_gpu_bwd1``'s
``g_A``, ``[m, B Tp, d]`` per target, at the timed shapes; not the taps or queries);
``"f32_rank5_loads"``, loads from a rank-5 float32 array (the mix's ``p`` rows, ``dstreams``'
per-token rows); ``"bf16_loads"``, loads from a bfloat16 array (the sources' lag windows). Each
maps to ``"evict_first"``, ``"evict_last"`` or ``"evict_normal"``.
"""

from __future__ import annotations

import contextlib
import math
import threading

POLICIES = ("evict_first", "evict_last", "evict_normal")
RULES = ("stores", "large_f32_loads", "f32_rank5_loads", "bf16_loads")
LARGE_BYTES = 16 * 2**20

_active = threading.local()


def rule_of(gmem_type, is_store: bool) -> str | None:
    """Which of ``RULES`` a copy with global ref type ``gmem_type`` (an ``ir.MemRefType``) matches."""
    from jaxlib.mlir import ir

    if is_store:
        return "stores"
    element = gmem_type.element_type
    if element == ir.F32Type.get():
        if gmem_type.rank == 5:
            return "f32_rank5_loads"
        if 4 * math.prod(gmem_type.shape) >= LARGE_BYTES:
            return "large_f32_loads"
    if element == ir.BF16Type.get():
        return "bf16_loads"
    return None


def _policy(name: str):
    """An i64 L2 cache policy made at the insertion point (PTX ``createpolicy``, fraction 1.0)."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import llvm

    level = {"evict_first": "L2::evict_first", "evict_last": "L2::evict_last",
             "evict_normal": "L2::evict_normal"}[name]
    return llvm.inline_asm(ir.IntegerType.get_signless(64), [], f"createpolicy.fractional.{level}.b64 $0, 1.0;",
                           "=l", has_side_effects=False)


@contextlib.contextmanager
def hinted(rules: dict):
    """Within the ``with``, Mosaic GPU TMA copies matching ``rules`` (``{rule: policy}``, rules of
    ``RULES``, policies of ``POLICIES``) carry that L2 policy. Raises ``ValueError`` for an
    unknown rule or policy."""
    for rule, policy in rules.items():
        if rule not in RULES or policy not in POLICIES:
            raise ValueError(f"l2 hint {rule}={policy}: rules are {RULES}, policies {POLICIES}")
    from jax.experimental.mosaic.gpu import launch_context
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import llvm, scf

    nvvm = launch_context.nvvm
    real_copy = launch_context.LaunchContext.async_copy
    real_load, real_store = nvvm.cp_async_bulk_tensor_shared_cluster_global, nvvm.cp_async_bulk_tensor_global_shared_cta

    def async_copy(self, *, src_ref, dst_ref, **kw):
        src_type, dst_type = ir.MemRefType(src_ref.type), ir.MemRefType(dst_ref.type)
        is_store = src_type.memory_space is not None
        _active.policy = rules.get(rule_of(dst_type if is_store else src_type, is_store))
        try:
            return real_copy(self, src_ref=src_ref, dst_ref=dst_ref, **kw)
        finally:
            _active.policy = None

    def with_hint(real, cluster_dst: bool):
        def op(*args, **kw):
            policy = getattr(_active, "policy", None)
            if policy is None or kw.get("l2_cache_hint") is not None:
                return real(*args, **kw)
            if cluster_dst:  # the unpredicated load's form takes its shared destination as shared::cluster
                args = (llvm.addrspacecast(ir.Type.parse("!llvm.ptr<7>"), args[0]), *args[1:])
            # NVVM lowers a predicated TMA copy through inline PTX, which takes no cache hint:
            # the predicate becomes a branch around an unpredicated copy instead
            predicate = kw.pop("predicate", None)
            if predicate is None:
                return real(*args, **kw, l2_cache_hint=_policy(policy))
            branch = scf.IfOp(predicate)
            with ir.InsertionPoint(branch.then_block):
                out = real(*args, **kw, l2_cache_hint=_policy(policy))
                scf.yield_([])
            return out
        return op

    launch_context.LaunchContext.async_copy = async_copy
    nvvm.cp_async_bulk_tensor_shared_cluster_global = with_hint(real_load, cluster_dst=True)
    nvvm.cp_async_bulk_tensor_global_shared_cta = with_hint(real_store, cluster_dst=False)
    try:
        yield
    finally:
        launch_context.LaunchContext.async_copy = real_copy
        nvvm.cp_async_bulk_tensor_shared_cluster_global = real_load
        nvvm.cp_async_bulk_tensor_global_shared_cta = real_store
