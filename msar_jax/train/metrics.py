"""Run logs: JSONL (always) and TensorBoard (when ``tensorboardX`` is installed).

``<workdir>/metrics.jsonl`` holds one JSON object per line:

* ``{"kind": "train", "step": s, "loss", "cross_entropy", "aux_loss", "grad_norm",
  "update_norm", "param_norm", "lr", "step_time_s", "tokens_per_s", "mfu", "time"}``
  (``step`` counts completed optimizer steps, 1 after the first; ``mfu`` is null where the
  device's peak is unknown, e.g. on CPU);
* ``{"kind": "eval", "step": s, "val_loss", "val_bpb", "val_tokens", "time"}``.

A resumed run appends, so a step can appear twice (the run that crashed after its last
checkpoint, then the resumed run); ``read_jsonl`` keeps the last record of each (kind, step).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from msar_jax import accounting

JSONL_NAME = "metrics.jsonl"


def _clean(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf
    return value


class MetricsLogger:
    def __init__(self, workdir: str | os.PathLike, tensorboard: bool = True):
        self.path = Path(workdir) / JSONL_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        self.tb = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                SummaryWriter = None
            if SummaryWriter is not None:
                self.tb = SummaryWriter(str(Path(workdir) / "tensorboard"))

    def write(self, kind: str, step: int, values: dict) -> dict:
        record = {"kind": kind, "step": int(step), **{k: _clean(v) for k, v in values.items()},
                  "time": time.time()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.tb is not None:
            for key, value in record.items():
                if key not in ("kind", "step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tb.add_scalar(f"{kind}/{key}", value, int(step))
        return record

    def close(self) -> None:
        self._file.close()
        if self.tb is not None:
            self.tb.close()


def read_jsonl(path: str | os.PathLike, kind: str | None = None) -> list[dict]:
    """Records of a ``metrics.jsonl`` (or a workdir), last per (kind, step), sorted by step."""
    path = Path(path)
    if path.is_dir():
        path = path / JSONL_NAME
    latest: dict = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            if kind is None or rec.get("kind") == kind:
                latest[(rec.get("kind"), rec["step"])] = rec
    return sorted(latest.values(), key=lambda r: (r["step"], r.get("kind", "")))


class Throughput:
    """Step time, tokens/s and MFU from wall-clock time between completed steps."""

    def __init__(self, tokens_per_step: int, flops_per_token: float | None, peak_flops: float | None):
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak = peak_flops
        self.last = None

    def start(self) -> None:
        self.last = time.perf_counter()

    def tick(self) -> dict:
        now = time.perf_counter()
        dt = now - (self.last if self.last is not None else now)
        self.last = now
        tps = self.tokens_per_step / dt if dt > 0 else float("nan")
        mfu = None
        if self.flops_per_token and dt > 0:
            mfu = accounting.mfu(self.flops_per_token, tps, self.peak)
        return {"step_time_s": dt, "tokens_per_s": tps, "mfu": mfu}


class ProgressClock:
    """Steps per second and time remaining for the progress bar, from the first compiled step on.

    The first step a process runs includes tracing and compiling the train step (minutes for a
    large model, ~10 s for the smoke configs on a CPU), so a rate counted from the start of the
    run is far too low right after it: 5 hours remaining at step 1 of a 30-minute run. The clock
    starts when the first step ends and counts only the steps after it; until a second step has
    ended there is no rate and no estimate (``None``). Other one-off costs (the first
    evaluation compiles the eval step) are left out between ``pause()`` and ``resume()``;
    later evaluations and checkpoint saves stay in the rate, since they recur over the rest of
    the run as well.
    """

    def __init__(self, end_step: int, clock=time.perf_counter):
        self.end_step = end_step
        self.clock = clock
        self.first: tuple[int, float] | None = None  # (step, time) when the first step ended
        self.rate: float | None = None
        self.remaining_s: float | None = None
        self._paused_at: float | None = None

    def pause(self) -> None:
        self._paused_at = self.clock()

    def resume(self) -> None:
        """Leave the time since ``pause()`` out of the rate (the clock's origin moves by it)."""
        if self._paused_at is not None and self.first is not None:
            self.first = (self.first[0], self.first[1] + self.clock() - self._paused_at)
        self._paused_at = None

    def tick(self, step: int) -> tuple[float | None, float | None]:
        """Record that ``step`` has ended; return ``(steps per second, seconds remaining)``."""
        now = self.clock()
        if self.first is None:
            self.first = (step, now)
        elif step > self.first[0] and now > self.first[1]:
            self.rate = (step - self.first[0]) / (now - self.first[1])
            self.remaining_s = max(self.end_step - step, 0) / self.rate
        return self.rate, self.remaining_s

    def describe(self) -> str:
        """``"2.31 step/s, 0:05:12 left"``; ``"compiling"`` / ``"timing"`` before a rate exists."""
        if self.first is None:
            return "compiling"
        if self.rate is None:
            return "timing"
        seconds = int(round(self.remaining_s))
        return f"{self.rate:.3g} step/s, {seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d} left"
