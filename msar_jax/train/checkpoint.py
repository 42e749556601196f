"""orbax checkpoints of a run: train state, data-iterator position and a JSON record.

A checkpoint at step ``s`` (``<workdir>/checkpoints/<s>/``) holds three items:

* ``state``: the train state ``{"step", "params", "opt_state"}`` (``StandardSave``);
* ``data``: the grain iterator's position (``msar_jax.data.checkpoint_save_args``), so a
  resumed run reads exactly the batches the uninterrupted run would have read;
* ``meta``: JSON (``step``, wall time, last loss, why it was saved).

Saves are asynchronous when ``checkpoint.async_save`` is on: ``save`` returns once the arrays
are copied off the device, and the files are written in the background (the train step may
donate the state's buffers right after). ``close()`` waits for the last write.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from msar_jax import data


class Checkpointer:
    def __init__(self, workdir: str | os.PathLike, keep: int = 3, async_save: bool = True):
        self.directory = Path(workdir).resolve() / "checkpoints"
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._saved: set[int] = set()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: dict, iterator, meta: dict) -> bool:
        """Save (async if configured); a step that already has a checkpoint is skipped."""
        if step in self._saved or step in self.manager.all_steps():
            return False
        self._saved.add(step)
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=data.checkpoint_save_args(iterator),
            meta=ocp.args.JsonSave(meta),
        )
        return self.manager.save(step, args=args, force=True)

    def restore(self, abstract_state: dict, iterator, step: int | None = None) -> tuple[dict, dict]:
        """Restore ``(state, meta)`` at ``step`` (default the newest); ``iterator`` in place."""
        step = self.manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        items = dict(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
        if iterator is not None:
            items["data"] = data.checkpoint_restore_args(iterator)
        out = self.manager.restore(step, args=ocp.args.Composite(**items))
        return out["state"], out["meta"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def restore_params(workdir: str | os.PathLike, abstract_state: dict, step: int | None = None) -> tuple[dict, int]:
    """The params of a run's checkpoint (default the newest) and the step they are from."""
    ckpt = Checkpointer(workdir, async_save=False)
    try:
        step = ckpt.latest_step() if step is None else step
        state, _ = ckpt.restore(abstract_state, None, step)
    finally:
        ckpt.close()
    return state["params"], int(step)
