"""Tasks by name: what the model is asked and how its answer is scored, one module
per task family (base.py: the protocol and the registry; `tasks.sources` builds a
run's records, reward and demonstrations through `get(cfg.data.source)`)."""

from dora_jax.tasks.base import Task, get, names, register, unregister

__all__ = ["Task", "get", "names", "register", "unregister"]
