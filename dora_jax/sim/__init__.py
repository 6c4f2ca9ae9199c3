"""Cluster simulator (no JAX): the real scheduling core at pod scale, with a cost
model for slices and trainer (cost.py), multi-turn episodes (episodes.py),
deployments to plan (presets.py), the event-driven cluster (cluster.py) and one
run's outputs (run.py)."""

from dora_jax.sim.cost import CostModel, Workload
from dora_jax.sim.episodes import Episode, Turns
from dora_jax.sim.presets import PRESETS, Preset
from dora_jax.sim.run import SIM_MODES, simulate

__all__ = ["CostModel", "Episode", "PRESETS", "Preset", "SIM_MODES", "Turns", "Workload",
           "simulate"]
