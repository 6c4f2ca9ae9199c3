"""Where metric records go: one interface, several writers.

A writer has `write(record)` and `close()`; a record is a dict with an integer
`step` (metrics.jsonl's lines: a train step's record, or an evaluation's, whose step
is the policy version it evaluated). `report.StepReporter` hands every record to
each writer on its own thread. The writers:

- `JsonlWriter`: `<workdir>/metrics.jsonl`, one JSON line per record (always on).
- `tensorboard.TensorBoardWriter`: the record's numbers as TensorBoard scalars
  (`logging.tensorboard`, on by default).
- `WandbWriter`: the same scalars to a Weights & Biases run (`logging.wandb_project`;
  off by default). `wandb` is imported only when configured, and a config that asks
  for it without the package installed fails before any compute, naming the field.

`make_writers(cfg, workdir, purge_step)` builds the set a run config asks for.
"""

from __future__ import annotations

import importlib
import json
import os
import types
from typing import Protocol

from dora_jax.config.report import LoggingConfig
from dora_jax.config.schema import ConfigError
from dora_jax.runtime.tensorboard import flatten


class MetricWriter(Protocol):
    """Receives every metrics record of a run, in order, on one thread."""

    def write(self, record: dict) -> None: ...

    def close(self) -> None: ...


class JsonlWriter:
    """Appends each record to a JSON-lines file, flushed per record so that a crash
    loses at most the line being written."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def import_wandb() -> types.ModuleType:
    """The `wandb` module; a ConfigError naming `logging.wandb_project` if it is not
    installed (the only field that turns it on)."""
    try:
        return importlib.import_module("wandb")
    except ImportError as e:
        raise ConfigError("config.logging.wandb_project: is set, but the `wandb` package "
                          "is not installed (pip install wandb), or unset it to log to "
                          "metrics.jsonl and TensorBoard only") from e


class WandbWriter:
    """Logs each record's numbers (tags as TensorBoard's, `tensorboard.flatten`) to a
    W&B run: a step's at its step, an evaluation's against `eval/version`.

    The run's id is kept in `<workdir>/wandb_run_id`, so a resumed run continues the
    same W&B run; W&B keeps the steps it already has (it drops a step lower than one
    it logged), where TensorBoard and metrics.jsonl replace the steps trained again.
    """

    ID_FILE = "wandb_run_id"

    def __init__(self, cfg: LoggingConfig, workdir: str, run_config: dict | None = None) -> None:
        wandb = import_wandb()
        id_path = os.path.join(workdir, self.ID_FILE)
        if os.path.exists(id_path):
            with open(id_path) as f:
                run_id = f.read().strip()
        else:
            run_id = wandb.util.generate_id()
            with open(id_path, "w") as f:
                f.write(run_id + "\n")
        self._run = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity or None,
                               name=cfg.wandb_run_name or os.path.basename(
                                   os.path.abspath(workdir)),
                               id=run_id, resume="allow", dir=workdir, mode=cfg.wandb_mode,
                               config=run_config)
        # Evaluations are reported once scored, possibly after later steps' records:
        # W&B drops a step lower than one it has, so they are charted against their
        # own axis, the version they evaluated, and logged at W&B's current step.
        self._run.define_metric("eval/*", step_metric="eval/version")

    def write(self, record: dict) -> None:
        if "eval" in record:
            self._run.log(flatten(record))
        else:
            self._run.log(flatten(record), step=int(record["step"]))

    def close(self) -> None:
        self._run.finish()


def make_writers(cfg: LoggingConfig, workdir: str, *, purge_step: int | None = None,
                 run_config: dict | None = None) -> list:
    """The writers `cfg` asks for, under `workdir`: metrics.jsonl, then TensorBoard
    (dropping the events of steps >= `purge_step`, which a resumed run trains again),
    then W&B (`run_config`: the run's config, shown with the W&B run)."""
    writers: list = [JsonlWriter(os.path.join(workdir, "metrics.jsonl"))]
    if cfg.tensorboard:
        from dora_jax.runtime.tensorboard import TensorBoardWriter

        writers.append(TensorBoardWriter(os.path.join(workdir, "tensorboard"), purge_step))
    if cfg.wandb_project:
        writers.append(WandbWriter(cfg, workdir, run_config))
    return writers
