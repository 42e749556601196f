"""Mosaic TPU implementation: ``pl.pallas_call`` with BlockSpecs and
``pltpu.CompilerParams(dimension_semantics=...)`` (kernels in ``fused.py``).

Run here in interpret mode (no TPU). The forward kernels also **compile for a TPU v5p with
libtpu's ahead-of-time compiler on a CPU machine** (``benchmarks/tpu_kernels_aot.py``; the
command and the result are in BENCHMARKS.md): MSAR with segments and the gate, AttnRes, MHAR, no-conv; phase 1 and phase 2,
forward and with the default XLA backward. What that took (fused.py): token-tile starts
marked ``pl.multiple_of`` (Mosaic proves aligned loads), the segment ids and the gate
statistics laid out with tokens on sublanes and a whole trailing dim (Mosaic's block-shape
rule: last two block dims whole or 8 x 128-aligned), and the per-head softmax weights read
as a row of heads and picked by a one-hot sum (no dynamic lane index). The Pallas backward
kernels (``backward="pallas"``: ``fused_bwd_phase1``, ``fused_bwd_phase2``) also lower
and compile for a TPU v5p (the same command: all cases, phase 1 and phase 2 forward+backward)
with the same treatment: segment ids as ``[B, Tp, 1]``; the per-token scalars they read (softmax weights,
key-norm coefficients, the gate's ``coef``) and write (chunk partials of ``<g_A, E>``, of
the gate statistics and of the ``d_state`` reductions) with tokens on sublanes and a whole
trailing dim, transposed back in XLA; per-head scalars of phase 2 picked by a one-hot sum.
``tests/kernels/test_triton_lowering.py`` checks the Mosaic lowering of both backwards on
every run (without libtpu). Known limit: the source BlockSpec spans the whole token axis of one
batch row (``[n, T, d]`` per program in the scores kernel), which overflows VMEM at long T;
a TPU-tuned version would DMA ``block_t + halo`` rows per program instead. Nothing here
has run on a TPU.
"""

from __future__ import annotations

from pallas_kernels.depth_attention import _backend, api

phase1, phase2, phase2_fused = _backend.build("tpu", native_platform="tpu")

api.register("phase1", "pallas_tpu", phase1)
api.register("phase2", "pallas_tpu", phase2)
api.register("phase2_fused", "pallas_tpu", phase2_fused)
