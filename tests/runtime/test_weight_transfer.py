"""A version's params from the trainer's process to a slice process, device to device
(runtime/weight_transfer.py): the pulled leaves equal the trainer's, in the slice's
decode shardings; with LoRA a slice that holds the base is offered the adapters only."""

import json
import subprocess
import sys

import jax
import numpy as np
from conftest import REPO, load_repo_config

from dora_jax.config import devices
from dora_jax.rollout.placement import ParamPlacement
from dora_jax.runtime import experiment
from dora_jax.runtime.weight_transfer import WeightOffers, staging_mesh

SPEC = "configs/tiny.py:spread"
OVERRIDES = dict(mesh__slice__tensor=2, mesh__num_slices=2)


def _offers(cfg):
    trainer_mesh, [slice_mesh, _] = devices.make_meshes(cfg.mesh)
    _, params = experiment.initial_params(cfg, trainer_mesh)
    stage = staging_mesh(list(trainer_mesh.devices.flat), slice_mesh.devices.shape)
    offers = WeightOffers(ParamPlacement(cfg.model, stage, cfg.mesh.decode_rules), "127.0.0.1")
    return offers, params, ParamPlacement(cfg.model, slice_mesh, cfg.mesh.decode_rules)


def test_a_slice_process_pulls_the_trainer_s_params_in_its_shardings():
    cfg = load_repo_config(SPEC, num_devices=8, **OVERRIDES)
    offers, params, local = _offers(cfg)
    doubled = jax.tree.map(lambda x: x * 2, params)
    pulls = [offers.offer(0, params, base_held=False), offers.offer(1, doubled, base_held=False)]
    out = subprocess.run([sys.executable, str(REPO / "tests/runtime/_weight_puller.py"), SPEC,
                          offers.address, *map(json.dumps, pulls)],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    placed = local.place(params)  # what one process would hold
    want = [float(np.asarray(x, np.float64).sum()) for x in placed.leaves]
    assert lines[0] == want and lines[2] == [2 * w for w in want]
    # The slice's own decode shardings (tensor-parallel over its 2 devices), not the
    # trainer's: some leaf is split.
    assert lines[1] == [str(x.sharding.spec) for x in placed.leaves]
    assert any("tensor" in spec for spec in lines[1])
    assert pulls[0][1] == list(range(len(want)))


def test_with_lora_a_slice_holding_the_base_is_offered_the_adapters_only():
    cfg = load_repo_config(SPEC, num_devices=8, model__lora__rank=4, model__lora__alpha=8.0,
                           **OVERRIDES)
    offers, params, _ = _offers(cfg)
    frozen = offers.frozen
    assert any(frozen) and not all(frozen)
    _, first = offers.offer(0, params, base_held=False)
    before = offers.offered_bytes
    _, then = offers.offer(1, params, base_held=True)
    assert first == list(range(len(frozen)))
    assert then == [i for i, f in enumerate(frozen) if not f]
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    assert 0 < offers.offered_bytes - before < total / 5
