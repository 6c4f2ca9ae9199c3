"""Benchmarks: each prints ratios measured side by side in one process.

Every benchmark is an absl program whose configs come from `--config=...` flags
(ml_collections' config_flags, as in `dora_jax.main`), with overrides
(`--config.rollout.slots_per_slice=16`). Defaults point into the package's configs
(dora_jax/configs, configs/ in a clone) so the commands work from any directory and
from an installed package.
"""

import pathlib

from dora_jax import configs

CONFIGS = pathlib.Path(configs.DIR)
