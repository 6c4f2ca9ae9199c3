"""Benchmarks: each prints ratios measured side by side in one process.

Every benchmark is an absl program whose configs come from `--config=...` flags
(ml_collections' config_flags, as in `dora_jax.main`), with overrides
(`--config.rollout.slots_per_slice=16`). Defaults point into the repository's
configs/ so the commands work from any directory.
"""

import pathlib

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
