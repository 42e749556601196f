"""Phase 1's scoring pass in Mosaic GPU (``phase1_scores``: every source's streams against every
target's query and themselves; ``fused.scores_call``'s sums). docs/kernels.md §4, "Phase 1
forward"."""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.depth_attention.fused import stream_layout
from pallas_kernels.depth_attention.mosaic_gpu.common import (
    BLOCK_T, F32, KernelConfig, LagWindow, expand_streams, fetch_partial, jitted_kernel, lane_plgpu, per_col,
    pipeline_chunks, smem_sum, stage_table_and_masks, store_group, tile_partial, window_elems,
)

def scores_smem_bytes(*, block_d: int, stream_kernels: Sequence[int], heads: int, x_dtype, n_targets: int,
                      n_sources: int, n_slots: int | None = None, **_unused) -> int:
    """Shared memory of one program of ``phase1_scores`` (its scratch list, ``smem_sum``)."""
    bt, bd, m = BLOCK_T, block_d, len(stream_kernels)
    n_taps, slots = max(1, sum(stream_kernels)), n_slots or SCORES_SLOTS
    return smem_sum(
        slots * window_elems(stream_kernels, bd) * jnp.dtype(x_dtype).itemsize,
        slots * n_taps * bd * 4, slots * n_targets * m * bd * 4, n_sources * 64 * 4, bt * 4,
        n_targets * m * heads * bt * 4, m * bt * 4, barriers=slots + 1, reduces=True)


# Channel chunks in flight in ``phase1_scores``'s TMA pipeline (the one being reduced and the next
# ``SCORES_SLOTS - 1``). 3 or 4 gave nothing on the H200 (within 5% either way).
SCORES_SLOTS = 2
# ``phase1_scores``'s channel chunks, first choice first (``choose_block_d``), for one stream and for
# several. Wider chunks mean fewer copies and fewer per-chunk reductions: on the H200
# one stream took 0.387 / 0.299 / 0.262 ms with 32 / 64 / 128 channels at `base` (0.448 /
# 0.346 / 0.292 at the bench shape); MSAR's four streams 1.787 / 1.676 (1.947 / 1.870), and 128
# channels would hold four [64, 128] float32 streams in registers (256 per thread) before any sum.
SCORES_BLOCK_D_CHOICES = {"one_stream": (128, 64, 32), "several": (64, 32)}


def scores_block_d_choices(n_streams: int) -> tuple:
    """The channel chunks ``phase1_scores`` tries, first choice first."""
    return SCORES_BLOCK_D_CHOICES["one_stream" if n_streams == 1 else "several"]


def phase1_scores(sources, banks, queries, segment_ids, valid, *, stream_kernels, heads: int,
                  block_d: int | None = None, n_slots: int | None = None, interpret: bool = False):
    """Phase 1's scoring pass (``fused.scores_call``'s sums) as one Mosaic GPU kernel: per
    (batch row, 64-token tile), for each valid source, the chunks of its lag windows stream
    through a double-buffered TMA pipeline, its streams are built in registers (Eq. 10) and
    reduced against every target's query and against themselves.

    ``sources[n, B, T, d]``, ``banks[n, K, d]`` or None, ``queries[S, m, d]``, ``segment_ids
    [B, T]`` or None, ``valid[n]`` (bool, may be traced) or None. Returns float32 ``dots[S, n,
    m, B, T, H]`` (``q_{s,r} . E_{i,r}`` per head) and ``sumsq[n, m, B, T]`` (``sum E_{i,r}^2``
    over all ``d``), zeros for a source ``valid`` rules out (not computed). ``n_slots``: channel
    chunks in flight (None: ``SCORES_SLOTS``; at least 2)."""
    n, batch, t_len, d = sources.shape
    n_targets, m = queries.shape[:2]
    n_slots = SCORES_SLOTS if n_slots is None else n_slots
    if n_slots < 2:
        raise ValueError(f"mosaic_gpu.phase1_scores: n_slots={n_slots}: must be at least 2 (one chunk reduced "
                         "while the next is copied)")
    if queries.shape[-1] != d or m != len(stream_kernels):
        raise ValueError(f"queries {queries.shape}: want [S, {len(stream_kernels)}, {d}]")
    smem = functools.partial(scores_smem_bytes, n_targets=n_targets, n_sources=n, n_slots=n_slots)
    sh = tile_partial("phase1_scores", sources.reshape(n * batch, t_len, d), segment_ids,
                      stream_kernels=stream_kernels, heads=heads, block_d=block_d, interpret=interpret, smem=smem,
                      x_dtype=sources.dtype, acc_dtype=F32, out_dtype=F32, choices=scores_block_d_choices(m))
    has_bank = sh.has_bank and banks is not None
    live = jnp.ones((n,), jnp.int32) if valid is None else jnp.asarray(valid, jnp.int32).reshape(n)
    inputs = [sh.x, jnp.asarray(banks, F32) if has_bank else jnp.zeros((n, 1, d), F32),
              jnp.asarray(queries, F32).reshape(n_targets * m, d), jnp.broadcast_to(live[:, None], (n, 64))]
    if sh.has_seg:
        inputs.append(sh.bits)
    call = _scores_kernel(ScoresConfig(n=n, batch=batch, t_pad=sh.t_pad, d=d, stream_kernels=tuple(stream_kernels),
                                       heads=heads, n_targets=n_targets, block_d=sh.block_d, has_bank=has_bank,
                                       has_seg=sh.has_seg, front=sh.front, x_dtype=jnp.dtype(sh.x.dtype),
                                       interpret=bool(interpret), n_slots=n_slots))
    dots, sumsq = call(*inputs)  # [n, S m H, B, Tp], [n, m, B, Tp]
    dots = dots.reshape(n, n_targets, m, heads, batch, sh.t_pad).transpose(1, 0, 2, 4, 5, 3)
    return dots[:, :, :, :, :t_len], sumsq[..., :t_len]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScoresConfig(KernelConfig):
    """What ``phase1_scores``' kernel code depends on besides ``KernelConfig``."""

    n: int  # sources
    n_targets: int
    has_bank: bool
    n_slots: int


@functools.lru_cache(maxsize=None)
def _scores_kernel(cfg: ScoresConfig):
    """``phase1_scores``' kernel for ``cfg``, built and jitted once (``KernelConfig``)."""
    plgpu = lane_plgpu()

    n, batch, d, heads, bd, n_targets = cfg.n, cfg.batch, cfg.d, cfg.heads, cfg.block_d, cfg.n_targets
    stream_kernels, has_bank, has_seg, front = cfg.stream_kernels, cfg.has_bank, cfg.has_seg, cfg.front
    m, bt = len(stream_kernels), BLOCK_T
    layout = stream_layout(stream_kernels)
    max_lag = max([1, *stream_kernels])
    lags, n_taps = LagWindow.of(max_lag), max(1, sum(stream_kernels))
    nc, smh = d // bd, n_targets * m * heads
    row, col = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    slots = cfg.n_slots
    scratch = dict(
        xs=plgpu.SMEM((slots, lags.count, lags.rows, lags.width(bd)), cfg.x_dtype),
        bs=plgpu.SMEM((slots, n_taps, bd), F32) if has_bank else None,
        qs=plgpu.SMEM((slots, n_targets * m, bd), F32),
        live_s=plgpu.SMEM((n, 64), jnp.int32),
        bits_s=plgpu.SMEM((bt,), jnp.int32) if has_seg else None,
        dots_s=plgpu.SMEM((smh, bt), F32),
        ss_s=plgpu.SMEM((m, bt), F32),
        bar=plgpu.Barrier(num_arrivals=lags.count + has_bank + 1, num_barriers=slots),
        bar_in=plgpu.Barrier(num_arrivals=1 + has_seg, num_barriers=1),
    )
    names = [k for k, v in scratch.items() if v is not None]

    def body(*refs):
        it = iter(refs)
        x_ref, bank_ref, q_ref, live_ref = (next(it) for _ in range(4))
        bits_ref = next(it) if has_seg else None
        dots_ref, ss_ref = next(it), next(it)
        sc = dict(zip(names, it))
        xs, bs, qs, live_s, bits_s, dots_s, ss_s = (sc.get(k) for k in ("xs", "bs", "qs", "live_s", "bits_s",
                                                                        "dots_s", "ss_s"))
        bar, bar_in = sc["bar"], sc["bar_in"]
        b, t0 = lax.axis_index("b"), lax.axis_index("t") * bt
        masks = stage_table_and_masks(plgpu, live_ref, live_s, bits_ref, bits_s, bar_in.at[0], b, t0, max_lag, bt, bd)
        zero = plgpu.layout_cast(jnp.zeros((bt,), F32), row)

        def staging_free():  # the last source's stores have read the staging buffers
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def stage_head(head, dots):  # one head's [S m] dots -> their rows of the staging buffer
            for sr in range(n_targets * m):
                dots_s[sr * heads + head] = dots[sr]

        def store(i, sqs):
            for r in range(m):
                ss_s[r] = sqs[r]
            plgpu.commit_smem()
            store_group(plgpu, ((dots_s, dots_ref.at[i, :, b, pl.ds(t0, bt)]),
                                (ss_s, ss_ref.at[i, :, b, pl.ds(t0, bt)])))

        def source_body(i, carry):
            def fetch(c, slot):
                fetch_partial(plgpu, x_ref, bank_ref.at[i] if has_bank else None, xs, bs, i * batch + b, t0,
                              front, c, bd, slot, bar, lags, max_lag)
                plgpu.copy_gmem_to_smem(q_ref.at[:, pl.ds(c * bd, bd)], qs.at[slot], bar.at[slot])

            # The loop carries the current head's S m dots only: each head's go to the staging
            # buffer when its chunks are done (``head_end``). Carried through every head's loop,
            # MHAR's 8 heads x 8 targets made 64 live accumulators: the pass alone 0.733 -> 0.602
            # ms at `base` with this (AttnRes's one head: 0.281).
            def chunk(c, slot, head, carry):
                dots, sqs = list(carry[0]), list(carry[1])
                for r, e in enumerate(expand_streams(plgpu, xs, bs, slot, layout, masks, bt, bd, lags)):
                    sqs[r] = sqs[r] + jnp.sum(e * e, axis=1)
                    for s in range(n_targets):
                        q = per_col(plgpu.load(qs, (slot, s * m + r), layout=col), bt, bd)
                        dots[s * m + r] = dots[s * m + r] + jnp.sum(e * q, axis=1)
                return dots, sqs

            def head_end(head, carry):
                dots, sqs = carry
                if head == 0:
                    staging_free()
                stage_head(head, dots)
                return ([zero] * (n_targets * m) if head + 1 < heads else dots), sqs

            @pl.when(live_s[i, 0] != 0)
            def _():
                _, sqs = pipeline_chunks(plgpu, fetch, bar, nc, heads, chunk, ([zero] * (n_targets * m), [zero] * m),
                                         n_slots=slots, head_end=head_end)
                store(i, sqs)

            @pl.when(live_s[i, 0] == 0)
            def _():
                staging_free()
                for head in range(heads):
                    stage_head(head, [zero] * (n_targets * m))
                store(i, [zero] * m)

            return carry

        lax.fori_loop(0, n, source_body, 0)
        plgpu.wait_smem_to_gmem(0)

    out_type = (jax.ShapeDtypeStruct((n, smh, batch, cfg.t_pad), F32),
                jax.ShapeDtypeStruct((n, m, batch, cfg.t_pad), F32))
    return jitted_kernel(plgpu, body, out_type, [scratch[k] for k in names], name="depth_attention_scores_mosaic",
                         batch=batch, t_pad=cfg.t_pad, interpret=cfg.interpret)
