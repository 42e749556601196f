"""The device's copy bandwidth, measured several ways: the ceiling every floor in BENCHMARKS.md
divides by.

``bench.copy_bandwidth`` (XLA's ``a + 1`` on 2 GiB of bf16) reads 3.13-3.22 TB/s on the H200,
where PyTorch's device-to-device copy reaches 4.27 TB/s, a third more; on an H100 it reads
2.86-2.92 against PyTorch's 3.0 (BENCHMARKS.md). If XLA's elementwise kernel is what falls short, the
floors overstate the time the design's bytes need. This probe times, on the same device:

- ``xla_add_2g`` / ``xla_add_8g``: ``bench.copy_bandwidth`` at 2 and 8 GiB;
- ``xla_copy_2g``: ``jnp.copy`` (a plain copy, no arithmetic);
- ``torch_copy_2g`` / ``torch_copy_8g``: PyTorch's ``Tensor.copy_`` timed with CUDA events (the
  4.27 TB/s measurement), where PyTorch is importable (the GPU image's ``python3`` has it).

Each figure counts bytes read plus bytes written, median of 21 timed repetitions after warm-up.
Prints one line per method and a JSON line for the log. Run: ``python3
benchmarks/mgpu/copy_ceiling.py`` (GPU)."""
import json
import statistics
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.depth_attention import bench

GIB = 1 << 30


def xla_rate(fn, nbytes):
    """Bytes read + written per second of ``fn`` on ``nbytes`` of bf16 (bench's timer)."""
    x = jax.random.normal(jax.random.key(0), (nbytes // 2,), jnp.bfloat16)
    seconds, _ = bench.timeit(jax.jit(fn), x, reps=21)
    return 2 * nbytes / seconds


def torch_rate(nbytes, reps=21):
    """PyTorch's device-to-device ``copy_`` with CUDA events, or None without PyTorch."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


def main():
    if jax.default_backend() != "gpu":
        sys.exit("copy_ceiling.py measures a GPU; run it on the device machine")
    rates = {
        "xla_add_2g": xla_rate(lambda a: a + jnp.bfloat16(1), 2 * GIB),
        "xla_add_8g": xla_rate(lambda a: a + jnp.bfloat16(1), 8 * GIB),
        "xla_copy_2g": xla_rate(jnp.copy, 2 * GIB),
        "torch_copy_2g": torch_rate(2 * GIB),
        "torch_copy_8g": torch_rate(8 * GIB),
    }
    device = jax.devices()[0].device_kind
    for name, rate in rates.items():
        print(f"{name:>14}: " + ("n/a (no PyTorch)" if rate is None else f"{rate / 1e12:.2f} TB/s") + f"  ({device})")
    print(json.dumps({"device": device, **{k: v and round(v / 1e12, 3) for k, v in rates.items()}}))


if __name__ == "__main__":
    main()
