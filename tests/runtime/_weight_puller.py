"""A slice process's side of tests/runtime/test_weight_transfer.py: pulls the offers
named on the command line into a slice's shardings and prints each leaf's sum."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2 " + " ".join(
    f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)

import numpy as np  # noqa: E402
from conftest import load_repo_config  # noqa: E402

from dora_jax.rollout.placement import ParamPlacement  # noqa: E402
from dora_jax.runtime import slice_process  # noqa: E402
from dora_jax.runtime.weight_transfer import WeightPuller, start_server  # noqa: E402

spec, address, *pulls = sys.argv[1:]
cfg = load_repo_config(spec, num_devices=8, mesh__slice__tensor=2, mesh__num_slices=2)
[mesh] = slice_process.slice_meshes(cfg, 1)
placement = ParamPlacement(cfg.model, mesh, cfg.mesh.decode_rules)
puller = WeightPuller(placement, start_server("127.0.0.1"), address)
for pull in pulls:
    number, leaves = json.loads(pull)
    params = puller.pull(number, leaves)
    print(json.dumps([float(np.asarray(x, np.float64).sum()) for x in params.leaves]))
    print(json.dumps([str(x.sharding.spec) for x in params.leaves]))
