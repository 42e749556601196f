"""Phase 2's scoring pass written for Mosaic GPU (``plgpu.kernel``), to time against the
Triton kernel (``fused.scores_call``): the measurement the choice of GPU backend rests on
(docs/kernels.md). Prototype: one head, no segment ids, T a multiple of
``bt``, ``d`` of ``bd``; not wired into ``pallas_kernels``.

Per program (batch row b, token tile t of ``bt`` rows, one warpgroup), a loop over the
``bd``-channel chunks with a double-buffered TMA pipeline: the chunk's rows of the partial,
its conv taps and its queries go to shared memory, the expansions ``E_r`` (Eq. 10) are built
in registers (``WGMMA`` layout) and reduced over the chunk's channels. Outputs ``dots[m, B, T]``
(``q_r . E_r``) and ``sumsq[m, B, T]`` (``sum E_r^2``).

Measured on the H200 (``time_scores.py``; exact against XLA): with one
TMA window per lag (``windows="tma"``), 64 x 32 tiles and TMA's zero fill before row 0, 0.339 ms
per call at `base` (64 x 1024 tokens, d = 1024) against the Triton kernel's 0.526, and 0.182
against 0.310 at the bench shape (8 x 2048, d = 2048). Loading each lag from one window at a
row offset (``windows="offset"``) is exact in interpret mode but gave wrong conv streams on the
GPU (the identity stream, loaded at row offset 16, is exact; every stream with lags at
offsets 15 down to 5 is wrong; not investigated further)."""
from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

F32 = jnp.float32


def _layout(kernels):
    out, off = [], 0
    for k in kernels:
        out.append((k, off))
        off += k
    return out


def scores_mgpu(x, bank, q, *, kernels, bt=64, bd=128, halo=16, windows="offset", pad=True, interpret=False):
    """``x[B, T, d]`` (bf16), ``bank[K, d]`` (f32), ``q[m, d]`` (f32) -> ``(dots, sumsq)``, each
    ``[m, B, T]`` float32.

    ``windows``: how a lag's rows ``[t0 - delta, t0 - delta + bt)`` reach the registers.
    ``"offset"``: one TMA copy of ``bt + halo`` rows per chunk, each lag loaded from shared
    memory at row offset ``halo - delta``: exact in interpret mode, WRONG on the H200 (the
    identity stream is exact, the conv streams are not).
    ``"tma"``: one TMA copy per lag into its own ``[bt, bd]`` buffer, loaded at row 0 (the
    rows come from L2 after the first copy; shared memory holds ``max_kernel`` windows).
    ``pad``: the rows before token 0 as zeros padded in front of ``x`` (an XLA copy; Pallas'
    interpret mode needs it); False: the ``"tma"`` windows start before row 0 and TMA fills
    those rows with zeros (on the GPU only)."""
    assert windows in ("offset", "tma") and (pad or windows == "tma")
    shift = 0 if pad else halo  # row of x at window row 0 is t0 + halo - delta - shift
    batch, t_len, d = x.shape
    m, n_taps = len(kernels), bank.shape[0]
    nc = d // bd
    assert t_len % bt == 0 and d % bd == 0 and max(kernels) <= halo + 1
    row = plgpu.Layout.WGMMA.reduce(1)  # one value per token row
    col = plgpu.Layout.WGMMA.reduce(0)  # one value per channel

    def body(x_ref, bank_ref, q_ref, dots_ref, sq_ref, xs, bs, qs, bar, out_s):
        b, t = lax.axis_index("b"), lax.axis_index("t")
        t0 = t * bt

        def fetch(c, slot):
            if windows == "offset":
                plgpu.copy_gmem_to_smem(x_ref.at[b, pl.ds(t0, bt + halo), pl.ds(c * bd, bd)], xs.at[slot],
                                        bar.at[slot])
            else:
                for delta in range(n_windows):
                    plgpu.copy_gmem_to_smem(x_ref.at[b, pl.ds(t0 + halo - delta - shift, bt), pl.ds(c * bd, bd)],
                                            xs.at[slot, delta], bar.at[slot])
            plgpu.copy_gmem_to_smem(bank_ref.at[:, pl.ds(c * bd, bd)], bs.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(q_ref.at[:, pl.ds(c * bd, bd)], qs.at[slot], bar.at[slot])

        fetch(0, 0)

        @pl.when(nc > 1)
        def _():
            fetch(1, 1)

        def step(c, carry):
            dots, sqs = carry
            slot = lax.rem(c, 2)
            plgpu.barrier_wait(bar.at[slot])
            xw, bw, qw = xs.at[slot], bs.at[slot], qs.at[slot]
            new_dots, new_sqs = [], []
            def lag(delta):
                if windows == "offset":
                    return plgpu.load(xw, (pl.ds(halo - delta, bt), slice(None)), layout=plgpu.Layout.WGMMA)
                return plgpu.load(xw, (delta, slice(None), slice(None)), layout=plgpu.Layout.WGMMA)

            for r, (kernel, off) in enumerate(_layout(kernels)):
                if kernel == 0:
                    e = lag(0).astype(F32)
                else:
                    e = None
                    for delta in range(kernel):
                        xl = lag(delta).astype(F32)
                        tap = plgpu.load(bw, (off + delta, slice(None)), layout=col)
                        term = lax.broadcast_in_dim(tap, (bt, bd), [1]) * xl
                        e = term if e is None else e + term
                qr = plgpu.load(qw, (r, slice(None)), layout=col)
                new_dots.append(dots[r] + jnp.sum(e * lax.broadcast_in_dim(qr, (bt, bd), [1]), axis=1))
                new_sqs.append(sqs[r] + jnp.sum(e * e, axis=1))

            @pl.when(c + 2 < nc)
            def _():
                fetch(c + 2, slot)

            return new_dots, new_sqs

        zero = plgpu.layout_cast(jnp.zeros((bt,), F32), row)
        dots, sqs = lax.fori_loop(0, nc, step, ([zero] * m, [zero] * m))
        for r in range(m):
            out_s[r] = dots[r]
            out_s[m + r] = sqs[r]
        plgpu.commit_smem()
        for r in range(m):
            plgpu.copy_smem_to_gmem(out_s.at[r], dots_ref.at[r, b, pl.ds(t0, bt)])
            plgpu.copy_smem_to_gmem(out_s.at[m + r], sq_ref.at[r, b, pl.ds(t0, bt)])
        plgpu.wait_smem_to_gmem(0)

    n_windows = max(1, *kernels)
    x_smem = (2, bt + halo, bd) if windows == "offset" else (2, n_windows, bt, bd)
    arrivals = 3 if windows == "offset" else n_windows + 2
    out = jax.ShapeDtypeStruct((m, batch, t_len), F32)
    call = plgpu.kernel(
        body,
        out_type=(out, out),
        scratch_types=[
            plgpu.SMEM(x_smem, x.dtype),
            plgpu.SMEM((2, n_taps, bd), F32),
            plgpu.SMEM((2, m, bd), F32),
            plgpu.Barrier(num_arrivals=arrivals, num_barriers=2),
            plgpu.SMEM((2 * m, bt), F32),
        ],
        grid=(batch, t_len // bt),
        grid_names=("b", "t"),
        interpret=interpret,
    )
    # The halo rows before token 0 as zeros in memory: Pallas' interpret mode does not emulate
    # TMA's zero fill of out-of-bounds rows (a negative start left the first tile unwritten).
    return call(jnp.pad(x, ((0, 0), (halo, 0), (0, 0))) if pad else x, bank, q)


def scores_reference(x, bank, q, *, kernels):
    """The same sums in plain jnp (float32): ``E_r`` by the causal conv, no segments."""
    xf = x.astype(F32)
    dots, sqs = [], []
    for kernel, off in _layout(kernels):
        if kernel == 0:
            e = xf
        else:
            e = sum(bank[off + delta] * jnp.pad(xf, ((0, 0), (delta, 0), (0, 0)))[:, :xf.shape[1]]
                    for delta in range(kernel))
        dots.append(jnp.einsum("btd,d->bt", e, q[len(dots)]))
        sqs.append(jnp.sum(e * e, axis=-1))
    return jnp.stack(dots), jnp.stack(sqs)
