"""Orbax checkpoints of the train state (+ a JSON blob, e.g. the coordinator state).

Layout per step: `<dir>/<step>/state` (the train-state pytree: params, optimizer
state, step, version, optimizer-update count) and `<dir>/<step>/extra` (JSON).

Saving is asynchronous: `save` returns once the arrays are off the devices, so the
saved state may be donated to the next train step at once; `wait_until_finished()`
before reading the files or exiting. Restoring reads straight into an abstract
target's shardings (e.g. `Trainer.abstract_state()` on the *new* mesh), so a
checkpoint restores onto another trainer mesh shape. `restore_newest_intact` moves a
newest checkpoint that no longer reads aside and restores the one before;
`remove_stale_tmp` clears the temporary step directories of interrupted saves.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from dora_jax.base import untrusted_files
from dora_jax.model.hf_config import CheckpointError

_log = logging.getLogger(__name__)
# Orbax writes a step into `<step>.orbax-checkpoint-tmp` (orbax-checkpoint 0.12:
# atomicity_types.TMP_DIR_SUFFIX; older versions add `-<timestamp>`) and renames it
# once complete; one left behind is a save a crash interrupted.
TMP_MARK = ".orbax-checkpoint-tmp"
# The file Orbax's JsonCheckpointHandler writes the JSON blob to (orbax-checkpoint 0.12).
_EXTRA_FILE = "metadata"


@dataclasses.dataclass
class Restored:
    """What `Checkpointer.restore_newest_intact` restored."""

    step: int
    state: Any
    extra: dict
    # Newer checkpoints that failed to restore: {"step", "error", "moved_to"} each.
    skipped: list


def remove_stale_tmp(directory: str) -> list[str]:
    """Deletes the temporary step directories of interrupted saves in `directory`
    (a checkpoint root); returns their names. Only for start-up, before this
    process saves: a save in progress writes into such a directory."""
    if not os.path.isdir(directory):
        return []
    stale = sorted(n for n in os.listdir(directory) if TMP_MARK in n)
    for name in stale:
        path = os.path.join(directory, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)
        _log.warning("removed %s: a checkpoint save that a crash interrupted", path)
    return stale


class Checkpointer:
    """Thin wrapper over `orbax.checkpoint.CheckpointManager`.

    Args:
      directory: checkpoint root (created if missing; absolute path recommended).
      max_to_keep: newest checkpoints kept; older ones are deleted. None keeps all.
      save_interval_steps: `save` only writes when step % interval == 0 (unless forced).
      async_save: write in the background (see module docstring).
      this_process_only: in a `jax.distributed` world, this process saves and
        restores alone, with arrays it holds whole (runtime/trainer_group.py).
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
                 save_interval_steps: int = 1, async_save: bool = True,
                 this_process_only: bool = False):
        directory = os.fspath(directory)
        # A URL (gs://...) goes to Orbax as given: abspath would make it a local path.
        self.directory = directory if "://" in directory else os.path.abspath(directory)
        alone = {}
        if this_process_only and jax.process_count() > 1:
            me = jax.process_index()
            alone = dict(multiprocessing_options=ocp.options.MultiprocessingOptions(
                primary_host=me, active_processes={me}, barrier_sync_key_prefix=f"p{me}"))
            epath.Path(self.directory).mkdir(parents=True, exist_ok=True)  # Orbax won't
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_save, create=not alone, **alone)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: Any, extra_json: dict | None = None, *,
             force: bool = False) -> bool:
        """Saves `state` (any pytree of arrays, e.g. a TrainState) and `extra_json`
        (JSON-serialisable dict) as checkpoint `step`. Returns whether it saved
        (False when skipped by `save_interval_steps`)."""
        extra = {} if extra_json is None else dict(extra_json)
        return self._manager.save(
            int(step), force=force,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                    extra=ocp.args.JsonSave(extra)))

    @staticmethod
    def warm_up(state: Any) -> None:
        """Saves `state` once into a scratch directory and removes it, so that the
        programs a save compiles for these shapes and shardings (device-to-host
        copies of each sharded array) are compiled before the run: the first save in
        a process otherwise holds its caller for seconds (~2.5 s on the tiny config,
        against ~0.1 s for the next ones)."""
        with tempfile.TemporaryDirectory(prefix="checkpoint_warm_up_") as scratch:
            checkpointer = Checkpointer(scratch, max_to_keep=1)
            try:
                checkpointer.save(0, state, {}, force=True)
            finally:
                checkpointer.close()

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict]:
        """Restores checkpoint `step` (default: the latest) into `target`'s structure,
        shapes, dtypes and shardings. Returns `(state, extra_json)`.

        `target` is a pytree of `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` (or of
        arrays, whose shardings are used). FileNotFoundError if there is no checkpoint.
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
        if step not in self.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; "
                                    f"have {self.all_steps()}")
        self._check_extra(step)
        target = jax.tree.map(_abstract, target)
        out = self._manager.restore(
            int(step), args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                               extra=ocp.args.JsonRestore()))
        return out.state, dict(out.extra or {})

    def restore_newest_intact(self, target: Any) -> Restored | None:
        """The newest checkpoint that restores into `target` (as `restore`), or None
        if there is none. Each newer one that fails (a damaged disk) is logged, moved
        aside to `<step>.damaged` so that the run can save that step again, and
        listed in `skipped`. If none restores, the newest one's error is raised: the
        fault is then not in one checkpoint (e.g. another model)."""
        failed = []
        for step in sorted(self.all_steps(), reverse=True):
            try:
                state, extra = self.restore(target, step)
            except Exception as e:  # noqa: BLE001 - Orbax/TensorStore raise plain Exception
                failed.append((step, e))
                continue
            skipped = [self._set_aside(s, e, step) for s, e in failed]
            return Restored(step, state, extra, skipped)
        if failed:
            raise failed[0][1]
        return None

    def _set_aside(self, step: int, error: Exception, restored: int) -> dict:
        reason = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"[:300]
        # epath: the directory may be a gs:// URL (coordinator.checkpoint_dir).
        path = os.path.join(self.directory, str(step))
        moved = f"{path}.damaged"
        n = 1
        while epath.Path(moved).exists():
            n += 1
            moved = f"{path}.damaged{n}"
        epath.Path(path).rename(moved)
        self._manager.reload()  # it lists its steps once, when made
        _log.warning("checkpoint step %d in %s does not restore (%s); moved it to %s and "
                     "restored step %d", step, self.directory, reason, moved, restored)
        return {"step": step, "error": reason, "moved_to": moved}

    def restore_as_saved(self, step: int | None = None) -> Any:
        """Checkpoint `step` (default: the latest) as it was saved: nested dicts of
        host arrays, whatever the current model looks like."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
        out = self._manager.restore(
            int(step), args=ocp.args.Composite(state=ocp.args.StandardRestore(None),
                                               extra=ocp.args.JsonRestore()))
        return out.state

    def saved_tree(self, step: int | None = None) -> Any:
        """Checkpoint `step`'s (default: the latest) train-state tree as saved, with
        array metadata (shape, dtype) for leaves: no array is read."""
        step = self.latest_step() if step is None else step
        path = epath.Path(self.directory) / str(step) / "state"
        return ocp.StandardCheckpointHandler().metadata(path).tree

    def _check_extra(self, step: int) -> None:
        """Checks a local checkpoint's JSON blob before Orbax parses it: a regular
        file, capped, nesting bounded (untrusted_files). Orbax reads it whole with
        json.loads, so a FIFO there would hang the restore, a link to /dev/zero fill
        memory, and `[[[...]]]` raise a bare RecursionError."""
        if "://" in str(self.directory):
            return  # a bucket holds no FIFOs or links; Orbax reads it as it is
        path = os.path.join(self.directory, str(step), "extra", _EXTRA_FILE)
        if os.path.lexists(path):
            untrusted_files.loads(untrusted_files.read_bytes(
                path, untrusted_files.STATE_JSON_CAP, error=CheckpointError), path,
                CheckpointError)

    def read_extra(self, step: int) -> dict:
        """Checkpoint `step`'s JSON blob alone (the train state is not read)."""
        self._check_extra(step)
        out = self._manager.restore(int(step),
                                    args=ocp.args.Composite(extra=ocp.args.JsonRestore()))
        return dict(out.extra)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def wait_until_finished(self) -> None:
        """Blocks until every pending async save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_params(directory: str, like: Any) -> Any:
    """The params saved last in `directory` (e.g. by `dora_jax.sft`), restored with the
    structure, shapes, dtypes and shardings of `like`. Params saved with the layers
    unrolled load into a model that scans them, and the other way round
    (`model.scan_layers`). FileNotFoundError, naming the directory, if it holds no
    checkpoint (nothing is created there); ValueError if the params do not fit."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no checkpoint directory at {directory!r}")
    with Checkpointer(directory, async_save=False) as checkpointer:
        try:
            params, _ = checkpointer.restore(like)
        except ValueError as mismatch:
            raw = checkpointer.restore_as_saved()
            try:
                params = _relayout_blocks(raw, like)
            except (KeyError, ValueError) as e:
                raise ValueError(f"params in {directory!r} do not fit this model "
                                 f"({e}); Orbax: {str(mismatch)[:300]}") from mismatch
    return params


def _relayout_blocks(raw: dict, like: Any) -> Any:
    """`raw` (a restored params tree, nested dicts) in `like`'s layout of blocks:
    layer i unrolled is row i // p of stacked block i % p, where p is the number of
    stacked blocks (the dense/MoE period)."""
    have, want = raw["blocks"], like["blocks"]
    if len(have) > len(want):  # unrolled -> stacked
        p, n = len(want), len(have) // len(want)
        if len(have) != p * n:
            raise ValueError(f"{len(have)} saved layers do not stack into {p} blocks")
        blocks = {str(r): jax.tree.map(lambda *xs: np.stack(xs),
                                       *[have[str(j * p + r)] for j in range(n)])
                  for r in range(p)}
    elif len(have) < len(want):  # stacked -> unrolled
        p = len(have)
        blocks = {str(i): jax.tree.map(lambda x, i=i: np.asarray(x)[i // p], have[str(i % p)])
                  for i in range(len(want))}
    else:
        raise ValueError("the saved blocks have this model's layout, yet do not match it")
    raw = dict(raw, blocks=blocks)

    def pick(path: tuple, target: Any) -> jax.Array:
        node = raw
        for key in path:
            node = node[str(getattr(key, "key", getattr(key, "name", key)))]
        value = np.asarray(node)
        if value.shape != target.shape:
            raise ValueError(f"{jax.tree_util.keystr(path)}: saved shape {value.shape}, "
                             f"model {target.shape}")
        return jax.device_put(value.astype(target.dtype), getattr(target, "sharding", None))

    return jax.tree_util.tree_map_with_path(pick, like)


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
