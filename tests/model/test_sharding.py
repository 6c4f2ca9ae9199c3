"""Sharded forward/decode (trainer and decode-slice rules) equal the unsharded ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dora_jax import config as config_lib
from dora_jax.config import devices
from dora_jax.model import sharding
from dora_jax.model import transformer as tf


def test_logical_to_spec_rules():
    rules = config_lib.TRAINER_RULES
    assert sharding.logical_to_spec(("embed", "mlp"), rules) == P("fsdp", "tensor")
    # "batch" takes data+fsdp+expert, so "embed" (fsdp) is left replicated.
    assert sharding.logical_to_spec(("batch", "length", "embed"), rules) == P(
        ("data", "fsdp", "expert"), None, None)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2, 1), config_lib.TRAINER_MESH_AXES)
    # Size-1 mesh axes are dropped.
    assert sharding.logical_to_spec(("batch",), rules, mesh) == P(("data", "fsdp"))


def _trainer_mesh(shape):
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), config_lib.TRAINER_MESH_AXES)


def test_trainer_sharded_forward_equals_unsharded(tiny_cfg):
    """dense: data2 x fsdp2 x tensor2; moe: data2 x tensor2 x expert2."""
    cfg = tiny_cfg.model
    shape = (2, 1, 2, 2) if cfg.moe.enabled else (2, 2, 2, 1)
    graphdef, params = tf.create(cfg, seed=5)
    tokens = jax.random.randint(jax.random.key(0), (8, 12), 0, cfg.vocab_size)
    ref, ref_aux, _ = tf.apply(graphdef, params, tokens)

    mesh = _trainer_mesh(shape)
    rules = config_lib.TRAINER_RULES
    shardings = sharding.param_shardings(params, mesh, rules)
    sharded_params = jax.device_put(params, shardings)
    # The params really are split across devices (so the test could fail).
    wq = sharded_params["blocks"][0]["attn"]["wq"][...]
    fsdp = shape[1]
    # Layers are stacked: a leading, replicated "layers" axis.
    assert wq.sharding.spec == (P(None, "fsdp", "tensor", None) if fsdp > 1
                                else P(None, None, "tensor", None))
    assert wq.addressable_shards[0].data.shape == (cfg.num_layers, 64 // fsdp, 2, 16)
    if cfg.moe.enabled:
        w = sharded_params["blocks"][0]["mlp"]["w_gate"][...]
        assert w.sharding.spec == P(None, "expert", None, "tensor")

    batch_sharding = jax.sharding.NamedSharding(mesh, P(("data", "fsdp", "expert")))
    fwd = jax.jit(lambda p, t: tf.apply(graphdef, p, t)[:2],
                  in_shardings=(shardings, batch_sharding))
    with sharding.activation_rules(mesh, rules):
        out, aux = fwd(sharded_params, jax.device_put(tokens, batch_sharding))
    assert len(out.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-4, atol=2e-4)
    for key in ref_aux:
        # MoE losses, and the experts' loads (counts per layer and expert)
        np.testing.assert_allclose(np.asarray(aux[key]), np.asarray(ref_aux[key]), rtol=1e-4,
                                   atol=1e-6, err_msg=key)


def test_decode_rules_on_two_device_slice(tiny_cfg):
    cfg = tiny_cfg.model
    graphdef, params = tf.create(cfg, seed=2)
    B, S = 4, 10
    cache = tf.init_cache(cfg, B, S)
    tokens = jax.random.randint(jax.random.key(1), (B,), 0, cfg.vocab_size)
    pos = jnp.array([0, 3, 5, 9])
    ref, ref_cache = tf.decode(graphdef, params, tokens, pos, cache)

    axes = dict(tensor=2, expert=1)
    mesh = Mesh(np.array(jax.devices()[6:8]).reshape(2, 1), config_lib.SLICE_MESH_AXES)
    rules = config_lib.DECODE_RULES
    shardings = sharding.param_shardings(params, mesh, rules)
    sp = jax.device_put(params, shardings)
    # Stacked layers: a leading, replicated "layers" axis.
    assert sp["blocks"][0]["attn"]["wk"][...].sharding.spec == P(None, None, "tensor", None)
    assert axes["tensor"] == 2
    step = jax.jit(lambda p, t, q, c: tf.decode(graphdef, p, t, q, c))
    with sharding.activation_rules(mesh, rules):
        out, new_cache = step(sp, tokens, pos, cache)
    assert {d.id for d in out.sharding.device_set} <= {6, 7}
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(new_cache.k[1]), np.asarray(ref_cache.k[1]),
                               rtol=2e-4, atol=2e-5)


def test_make_meshes_disjoint_devices(load_config):
    cfg = load_config("configs/tiny.py:spread", num_devices=8)
    trainer, slices = devices.make_meshes(cfg.mesh)
    ids = [set(d.id for d in m.devices.flat) for m in [trainer, *slices]]
    assert sum(len(s) for s in ids) == len(set().union(*ids)) == 8
    assert trainer.shape == {"data": 2, "fsdp": 2, "tensor": 1, "expert": 1}


def test_make_meshes_colocated_slices_cover_the_trainer_devices(load_config):
    c = load_config("configs/tiny.py:spread", validate=False)
    c.coordinator.mode = "sync"
    c.mesh.update(config_lib.colocate(c.mesh.to_dict()))
    cfg = config_lib.validate(c, num_devices=8)
    trainer, slices = devices.make_meshes(cfg.mesh)
    slice_ids = [d.id for m in slices for d in m.devices.flat]
    assert sorted(slice_ids) == sorted(d.id for d in trainer.devices.flat) == list(range(8))


class _FakeTpu:
    """A device as the mesh code sees it: an id and the TPU slice it lies in. The
    CPU devices of these tests have no slice_index, so multi-slice layouts are shown
    on these (platform 'cpu': JAX's mesh_utils then keeps each slice's order)."""

    platform = device_kind = "cpu"
    process_index = 0

    def __init__(self, id, slice_index):
        self.id, self.slice_index = id, slice_index

    def __repr__(self):
        return f"d{self.id}@s{self.slice_index}"


def _multislice_devices(slices, total=256):
    # Interleaved as a runtime may list them: the mesh code regroups them by slice.
    return [_FakeTpu(i, i % slices) for i in range(total)] if slices > 1 else [
        _FakeTpu(i, 0) for i in range(total)]


@pytest.mark.parametrize("slices", [1, 2, 4])
def test_multislice_meshes_keep_fsdp_and_expert_inside_a_slice(load_config, slices):
    c = load_config("configs/moe.py", validate=False)
    c.mesh.trainer.update(dict(data=2, fsdp=8, tensor=1, expert=8))  # 128 chips
    mesh = config_lib.validate(c).mesh
    trainer, decode = devices.mesh_grids(mesh, _multislice_devices(slices))
    assert trainer.shape == (2, 8, 1, 8) and [g.shape for g in decode] == [(4, 4)] * 8
    flat = [d.id for g in [trainer, *decode] for d in g.flat]
    assert sorted(flat) == list(range(256))  # disjoint, every chip once
    for data in range(2):  # each fsdp x expert group (tensor is 1) lies in one slice
        assert len({d.slice_index for d in trainer[data, :, 0, :].flat}) == 1
    # The data axis is the one that crosses slices (4 slices: the trainer takes two).
    spans = {d.slice_index for d in trainer.flat}
    assert len(spans) == {1: 1, 2: 1, 4: 2}[slices]
    if len(spans) > 1:
        assert trainer[0].flat[0].slice_index != trainer[1].flat[0].slice_index
    for g in decode:  # a decode slice lies in one TPU slice, never the trainer's
        assert len({d.slice_index for d in g.flat}) == 1
        if slices > 1:
            assert not {d.slice_index for d in g.flat} & spans


def test_multislice_trainer_needs_a_data_axis_that_splits(load_config):
    c = load_config("configs/moe.py", validate=False)  # data=1 x fsdp=16 x expert=8
    mesh = config_lib.validate(c).mesh
    with pytest.raises(ValueError, match=r"data axis \(1\) must be a multiple of 2"):
        devices.mesh_grids(mesh, _multislice_devices(4))
    trainer, _ = devices.mesh_grids(mesh, _multislice_devices(2))  # 128 chips a slice
    assert len({d.slice_index for d in trainer.flat}) == 1


def test_trainer_gradients_compile_without_full_rematerialization(load_config, capfd):
    """The trainer's forward and backward on its FSDP mesh compile with no sharding
    XLA can only reach by replicating a tensor (its "Involuntary full
    rematerialization" warning, on stderr): the embedding lookup's gradient once was."""
    cfg = load_config("configs/tiny.py:spread", num_devices=8, model__num_layers=1)
    mesh, _ = devices.make_meshes(cfg.mesh)
    rules = cfg.mesh.trainer_rules
    graphdef, params = tf.create(cfg.model, seed=0)
    param_sh = sharding.param_shardings(params, mesh, rules)
    params = jax.device_put(params, param_sh)
    batch = sharding.logical_to_spec(("batch",), rules, mesh)
    tokens = jax.device_put(jnp.zeros((8, 32), jnp.int32),
                            jax.sharding.NamedSharding(mesh, P(batch[0], None)))

    def loss(p, tokens):
        return jnp.mean(tf.apply(graphdef, p, tokens)[0])

    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # a cached program warns not
    try:
        capfd.readouterr()
        with sharding.activation_rules(mesh, rules):
            # The gradients sharded as the params, as the train step keeps them.
            jax.jit(jax.grad(loss), out_shardings=param_sh).lower(params, tokens).compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
    assert "rematerialization" not in capfd.readouterr().err
