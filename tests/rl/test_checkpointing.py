"""Checkpoint round trips: values, JSON extra, restore onto another mesh shape, async
save followed by donation, retention."""


import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from dora_jax import config as config_lib
from dora_jax.model.checkpointing import Checkpointer
from dora_jax.model.sharding import param_specs
from dora_jax.rl.trainer import Trainer, TrainState


def trainer_mesh(data, fsdp, tensor):
    devices = np.array(jax.devices()[:data * fsdp * tensor]).reshape(data, fsdp, tensor, 1)
    return Mesh(devices, config_lib.TRAINER_MESH_AXES)


@pytest.fixture(scope="module")
def cfg(load_config):
    return load_config("configs/tiny.py:spread", num_devices=len(jax.devices()),
                       model__num_layers=1)


@pytest.fixture(scope="module")
def trainer(cfg):
    """A trainer on a data=2 x fsdp=2 mesh whose state is random, not the zero moments
    and counters of a fresh one, so equality after restore means something."""
    tr = Trainer(cfg, trainer_mesh(2, 2, 1))
    rng = np.random.default_rng(0)
    host = jax.device_get(tr.state)
    noisy = jax.tree.map(lambda x: (rng.standard_normal(x.shape) * 0.1 + x).astype(x.dtype),
                         host)
    tr.load_state(noisy._replace(step=np.int32(7), version=np.int32(7),
                                 opt_updates=np.int32(14)))
    return tr


def host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_round_trip_onto_another_mesh(tmp_path, cfg, trainer):
    expected = host(trainer.state)
    extra = {"coordinator": {"next_group": 12, "versions": [5, 6, 7]}, "note": "x"}
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.save(7, trainer.state, extra)
        ckpt.wait_until_finished()

    # A fresh process-equivalent: new manager, new trainer on fsdp=4 x tensor=2.
    other = Trainer(cfg, trainer_mesh(1, 4, 2))
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.latest_step() == 7
        state, got_extra = ckpt.restore(other.abstract_state())
    assert got_extra == extra
    assert isinstance(state, TrainState)
    for a, b in zip(host(state), expected):
        np.testing.assert_array_equal(a, b)

    specs = jax.tree.leaves(param_specs(state.params, cfg.mesh.trainer_rules, other.mesh),
                            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    for arr, spec in zip(jax.tree.leaves(state.params), specs):
        assert arr.sharding.mesh.shape == other.mesh.shape
        assert arr.sharding.spec == spec
    wq = state.params["blocks"][0]["attn"]["wq"][...]
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    # Everything, Adam moments included, lands on the new trainer's shardings.
    for arr, want in zip(jax.tree.leaves(state), jax.tree.leaves(other.abstract_state())):
        assert arr.sharding.is_equivalent_to(want.sharding, arr.ndim)
    mu_wq = state.opt_state[1][0].mu["blocks"][0]["attn"]["wq"][...]
    assert mu_wq.sharding.spec == wq.sharding.spec

    other.load_state(state)
    assert other.version == 7 and other.opt_updates == 14


def test_async_save_survives_donation(tmp_path, trainer):
    state = jax.device_get(trainer.state)  # host copy: `trainer` stays intact
    live = jax.device_put(state, jax.tree.map(lambda x: x.sharding, trainer.state))
    expected = host(live)
    ckpt = Checkpointer(tmp_path / "ckpt", async_save=True)
    ckpt.save(1, live, {"k": 1})
    # Donate the saved buffers right away, as the next train step does.
    bumped = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)(live)
    jax.block_until_ready(bumped)
    ckpt.wait_until_finished()
    restored, extra = ckpt.restore(trainer.abstract_state())
    ckpt.close()
    assert extra == {"k": 1}
    for a, b in zip(host(restored), expected):
        np.testing.assert_array_equal(a, b)


def test_retention_and_missing(tmp_path):
    tree = {"w": jnp.arange(4.0), "n": jnp.int32(0)}
    with pytest.raises(FileNotFoundError):
        Checkpointer(tmp_path / "empty").restore(tree)
    with Checkpointer(tmp_path / "ckpt", max_to_keep=2) as ckpt:
        for step in range(4):
            ckpt.save(step, {"w": tree["w"] + step, "n": jnp.int32(step)})
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [2, 3]
        state, extra = ckpt.restore(tree, step=2)
        assert extra == {}
        np.testing.assert_array_equal(state["w"], np.arange(4.0) + 2)
        assert int(state["n"]) == 2
        with pytest.raises(FileNotFoundError, match="step 0"):
            ckpt.restore(tree, step=0)


@pytest.mark.parametrize("saved_scanned", [False, True])
def test_params_load_across_layer_layouts(tmp_path, load_config, saved_scanned):
    """Params saved with layers unrolled load into a scanned model (and back), giving
    the saving model's logits; params of another shape are refused by name."""
    import dataclasses

    from dora_jax.model import transformer as tf
    from dora_jax.model.checkpointing import load_params

    base = load_config("configs/moe.py:tiny").model
    base = dataclasses.replace(base, num_layers=4,
                               moe=dataclasses.replace(base.moe, moe_every=2))
    saved_cfg = dataclasses.replace(base, scan_layers=saved_scanned)
    load_cfg = dataclasses.replace(base, scan_layers=not saved_scanned)
    graphdef, params = tf.create(saved_cfg, seed=3)
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.save(1, params, force=True)
    load_graphdef, like = tf.create(load_cfg, seed=9)  # other values, other layout
    loaded = load_params(str(tmp_path / "ck"), like)
    tokens = jax.random.randint(jax.random.key(0), (2, 7), 0, base.vocab_size)
    np.testing.assert_allclose(tf.apply(load_graphdef, loaded, tokens, dropless=True)[0],
                               tf.apply(graphdef, params, tokens, dropless=True)[0], atol=1e-5)
    _, wrong = tf.create(dataclasses.replace(load_cfg, mlp_hidden=8), seed=0)
    with pytest.raises(ValueError, match="do not fit this model"):
        load_params(str(tmp_path / "ck"), wrong)


def _damage_newest_data(directory, step):
    """Cuts the largest array file of checkpoint `step` short, as a bad disk would."""
    import glob
    import os

    data = max(glob.glob(f"{directory}/{step}/state/**/d/*", recursive=True),
               key=os.path.getsize)
    os.truncate(data, os.path.getsize(data) // 3)


# A restore that fails drops the reads of its other arrays unawaited; collected here,
# not in whichever test runs next.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_damaged_newest_checkpoint_gives_way_to_the_one_before(tmp_path, caplog):
    import os

    from dora_jax.model.checkpointing import remove_stale_tmp

    tree = {"w": jnp.arange(4096.0), "n": jnp.int32(0)}
    root = tmp_path / "ckpt"
    with Checkpointer(root) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": tree["w"] + step, "n": jnp.int32(step)}, {"at": step})
    _damage_newest_data(root, 3)
    with Checkpointer(root) as ckpt:
        with pytest.raises(Exception):  # noqa: B017 - what Orbax raises is not ours to name
            ckpt.restore(tree)
        with caplog.at_level("WARNING"):
            got = ckpt.restore_newest_intact(tree)
        assert (got.step, got.extra, int(got.state["n"])) == (2, {"at": 2}, 2)
        np.testing.assert_array_equal(got.state["w"], np.arange(4096.0) + 2)
        [skipped] = got.skipped
        assert skipped["step"] == 3 and skipped["moved_to"] == str(root / "3.damaged")
        assert "step 3" in caplog.text and "restored step 2" in caplog.text
        assert ckpt.all_steps() == [1, 2]
        ckpt.save(3, {"w": tree["w"], "n": jnp.int32(9)}, {"at": 9})  # step 3 saved again
    assert sorted(os.listdir(root)) == ["1", "2", "3", "3.damaged"]
    # Every checkpoint damaged: the newest one's own error, nothing moved.
    for step in (1, 2, 3):
        _damage_newest_data(root, step)
    with Checkpointer(root) as ckpt:
        with pytest.raises(Exception, match="reading array"):
            ckpt.restore_newest_intact(tree)
        assert ckpt.all_steps() == [1, 2, 3]
    with Checkpointer(tmp_path / "none") as empty:
        assert empty.restore_newest_intact(tree) is None
    # A save a crash interrupted leaves its temporary directory: removed at start-up.
    (root / "4.orbax-checkpoint-tmp").mkdir()
    (root / "4.orbax-checkpoint-tmp" / "x").write_text("partial")
    assert remove_stale_tmp(str(root)) == ["4.orbax-checkpoint-tmp"]
    assert sorted(os.listdir(root)) == ["1", "2", "3", "3.damaged"]
    assert remove_stale_tmp(str(tmp_path / "missing")) == []
    gc.collect()
