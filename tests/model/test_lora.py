"""LoRA: adapters leave the base exact until trained, compute W x + scale B A x (numpy
references), train alone, shard like their weights, fold into W for export, and
carry a small fraction of the weights' bytes."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lora_common import randomise_b
from _trainer_common import batch_of, trainer_mesh, trajectories
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dora_jax import config as config_lib
from dora_jax.config import LoRAConfig, ModelConfig, MoEConfig
from dora_jax.model import layers, lora, moe, sharding
from dora_jax.model import transformer as tf
from dora_jax.model.checkpointing import Checkpointer
from dora_jax.rl.trainer import Trainer

DENSE = ModelConfig(vocab_size=32, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1,
                    head_dim=8, mlp_hidden=24)
MOE = dataclasses.replace(DENSE, moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=12,
                                               num_shared_experts=1, shared_expert_hidden=8,
                                               capacity_factor=4.0))


def with_lora(cfg, **kw):
    return dataclasses.replace(cfg, lora=LoRAConfig(**{"rank": 4, "alpha": 8.0, **kw}))


def paths(tree):
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


TOKENS = jax.random.randint(jax.random.key(1), (2, 8), 0, 32)


def test_rank_zero_is_the_model_without_lora():
    """Rank 0 adds no param and ignores the other LoRA fields; the base of an
    adapted model is, bit for bit, the model without adapters (same seed)."""
    g0, p0 = tf.create(DENSE, 3)
    g1, p1 = tf.create(dataclasses.replace(DENSE, lora=LoRAConfig(alpha=-1.0, targets=("q",),
                                                                  dtype="bfloat16")), 3)
    assert paths(p0) == paths(p1) and not any("lora" in p for p in paths(p0))
    for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(tf.apply(g0, p0, TOKENS)[0], tf.apply(g1, p1, TOKENS)[0])
    base, adapters = lora.split(tf.create(with_lora(DENSE), 3)[1])
    assert paths(base) == paths(p0) and paths(adapters)
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(p0)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("kind", ["dense", "moe_dropless", "moe_capacity"])
def test_fresh_adapters_give_the_base_logits_exactly(kind, scan):
    base_cfg = DENSE if kind == "dense" else dataclasses.replace(
        MOE, moe=dataclasses.replace(MOE.moe, dispatch=kind.removeprefix("moe_")))
    base_cfg = dataclasses.replace(base_cfg, scan_layers=scan)
    cfg = with_lora(base_cfg, experts=base_cfg.moe.enabled)
    g0, p0 = tf.create(base_cfg, 0)
    g1, p1 = tf.create(cfg, 0)
    ref = tf.apply(g0, p0, TOKENS)[0]
    # B = 0 adds exactly zero, but the adapted program compiles to other fusions
    # (scanned layers: 5e-7 apart here), so the logits agree to rounding.
    np.testing.assert_allclose(tf.apply(g1, p1, TOKENS)[0], ref, rtol=0, atol=1e-5)
    # The adapters are in the computation: non-zero B moves the logits.
    assert not np.allclose(tf.apply(g1, randomise_b(p1), TOKENS)[0], ref, atol=1e-3)


def test_decoding_with_adapters_equals_the_full_forward():
    """What a decode slice computes from published adapted params (expert adapters
    included) is the trainer's forward."""
    cfg = with_lora(MOE, experts=True)
    g, p = tf.create(cfg, 0)
    p = randomise_b(p)
    full = jax.jit(lambda p: tf.apply(g, p, TOKENS, dropless=True)[0])(p)
    kv = jax.jit(lambda p: tf.apply(g, p, TOKENS[:, :5], dropless=True, return_kv=True)[2])(p)
    cache = tf.init_cache(cfg, 2, 8)
    cache = tf.LayerCaches(
        tuple(c.at[:, :, :5].set(kv.k[i].swapaxes(1, 2)) for i, c in enumerate(cache.k)),
        tuple(c.at[:, :, :5].set(kv.v[i].swapaxes(1, 2)) for i, c in enumerate(cache.v)))
    logits, _ = jax.jit(functools.partial(tf.decode, g))(p, TOKENS[:, 5], jnp.full((2,), 5),
                                                         cache)
    assert float(jnp.max(jnp.abs(full[:, 5] - full[:, 5].mean()))) > 0.1
    np.testing.assert_allclose(logits, full[:, 5], rtol=1e-4, atol=1e-4)


def _silu(x):
    return x / (1 + np.exp(-x))


def _ab(adapter, scale):
    """A, B as numpy (f32) and the term x -> scale * (x A) B of 2-D x."""
    a, b = np.asarray(adapter.lora_a[...]), np.asarray(adapter.lora_b[...])
    return lambda x: scale * (x.reshape(len(x), -1) @ a.reshape(-1, a.shape[-1])) @ b.reshape(
        b.shape[0], -1)


def test_projection_delta_matches_numpy():
    """q at position 0 (no rotation, no norm), o and the SwiGLU against W x + scale
    B A x written in numpy."""
    cfg = with_lora(dataclasses.replace(DENSE, qk_norm=False), alpha=6.0)
    scale = 6.0 / 4
    attn = layers.Attention(cfg, rngs=nnx.Rngs(params=0))
    for ad in (attn.lora_q, attn.lora_o):
        ad.lora_b[...] = jax.random.normal(jax.random.key(2), ad.lora_b.shape)
    x = np.asarray(jax.random.normal(jax.random.key(3), (5, 16)))
    q, _, _ = attn._qkv(jnp.asarray(x)[None], jnp.zeros((1, 5), jnp.int32))
    want_q = x @ np.asarray(attn.wq[...]).reshape(16, -1) + _ab(attn.lora_q, scale)(x)
    np.testing.assert_allclose(np.asarray(q[0]).reshape(5, -1), want_q, rtol=1e-5, atol=1e-5)
    o = np.asarray(jax.random.normal(jax.random.key(4), (5, 2, 8)))
    want_o = o.reshape(5, -1) @ np.asarray(attn.wo[...]).reshape(-1, 16) + _ab(
        attn.lora_o, scale)(o)
    np.testing.assert_allclose(np.asarray(attn._out(jnp.asarray(o)[None])[0]), want_o,
                               rtol=1e-5, atol=1e-5)

    mlp = layers.SwiGLU(16, 24, jnp.float32, jnp.float32, rngs=nnx.Rngs(params=1), cfg=cfg)
    for ad in (mlp.lora_gate, mlp.lora_up, mlp.lora_down):
        ad.lora_b[...] = jax.random.normal(jax.random.key(5), ad.lora_b.shape)
    w = {n: np.asarray(getattr(mlp, f"w_{n}")[...]) for n in ("gate", "up", "down")}
    d = {n: _ab(getattr(mlp, f"lora_{n}"), scale) for n in ("gate", "up", "down")}
    h = _silu(x @ w["gate"] + d["gate"](x)) * (x @ w["up"] + d["up"](x))
    np.testing.assert_allclose(np.asarray(mlp(jnp.asarray(x)[None])[0]),
                               h @ w["down"] + d["down"](h), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dropless", [True, False])
def test_expert_adapters_match_numpy(dropless):
    """Each token through its top-k experts, each expert with its own A and B."""
    cfg = with_lora(dataclasses.replace(MOE, moe=dataclasses.replace(
        MOE.moe, num_shared_experts=0)), experts=True, targets=("gate", "up", "down"))
    layer = moe.MoE(cfg, rngs=nnx.Rngs(params=0))
    for ad in (layer.lora_gate, layer.lora_up, layer.lora_down):
        ad.lora_b[...] = jax.random.normal(jax.random.key(6), ad.lora_b.shape)
    x = np.asarray(jax.random.normal(jax.random.key(7), (6, 16)))
    y, aux = layer(jnp.asarray(x)[None], dropless=dropless)
    assert float(aux["dropped_fraction"]) == 0.0
    ab = {n: (np.asarray(getattr(layer, f"lora_{n}").lora_a[...]),
              np.asarray(getattr(layer, f"lora_{n}").lora_b[...])) for n in ("gate", "up", "down")}
    w = {n: np.asarray(getattr(layer, f"w_{n}")[...]) for n in ("gate", "up", "down")}
    s = cfg.lora.scale

    def proj(n, e, v):
        a, b = ab[n]
        return v @ w[n][e] + s * (v @ a[e]) @ b[e]

    want = np.zeros_like(x)
    for i, v in enumerate(x):
        logits = v @ np.asarray(layer.router[...])
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p, kind="stable")[:2]
        for e, we in zip(top, p[top] / p[top].sum()):
            want[i] += we * proj("down", e, _silu(proj("gate", e, v)) * proj("up", e, v))
    np.testing.assert_allclose(np.asarray(y[0]), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("base_cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_merged_weights_give_the_adapted_logits(base_cfg):
    cfg = with_lora(base_cfg, experts=base_cfg.moe.enabled)
    g, p = tf.create(cfg, 0)
    p = randomise_b(p)
    merged = lora.merged_weights(p, cfg.lora)
    g0, p0 = tf.create(base_cfg, 0)
    assert paths(merged) == paths(p0)
    np.testing.assert_allclose(tf.apply(g0, merged, TOKENS)[0], tf.apply(g, p, TOKENS)[0],
                               rtol=1e-4, atol=1e-4)


def test_adapters_shard_like_their_weights_and_sharded_equals_unsharded(load_config):
    """MoE with expert adapters under the trainer rules, data2 x tensor2 x expert2."""
    cfg = with_lora(load_config("configs/moe.py:tiny", model__num_layers=1).model, experts=True)
    g, p = tf.create(cfg, 5)
    p = randomise_b(p, std=0.1)
    ref = jax.jit(lambda p, t: tf.apply(g, p, t)[0])(p, TOKENS)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 1, 2, 2), config_lib.TRAINER_MESH_AXES)
    rules = config_lib.TRAINER_RULES
    shardings = sharding.param_shardings(p, mesh, rules)
    sp = jax.device_put(p, shardings)
    attn, mlp = sp["blocks"][0]["attn"], sp["blocks"][0]["mlp"]
    assert attn["lora_q"]["lora_b"][...].sharding.spec == P(None, None, "tensor", None)
    assert attn["lora_o"]["lora_a"][...].sharding.spec == P(None, "tensor", None, None)
    assert mlp["lora_gate"]["lora_b"][...].sharding.spec == P(None, "expert", None, "tensor")
    assert mlp["shared"]["lora_down"]["lora_a"][...].sharding.spec == P(None, "tensor", None)
    batch = jax.sharding.NamedSharding(mesh, P(("data", "fsdp", "expert")))
    tokens = jnp.tile(TOKENS, (4, 1))
    fwd = jax.jit(lambda p, t: tf.apply(g, p, t)[0], in_shardings=(shardings, batch))
    with sharding.activation_rules(mesh, rules):
        out = fwd(sp, jax.device_put(tokens, batch))
    assert len(out.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(out)[:2], np.asarray(ref), rtol=2e-4, atol=2e-4)


@pytest.fixture(scope="module")
def lora_trainer(load_config):
    cfg = load_config("configs/tiny.py:spread", num_devices=len(jax.devices()), model__num_layers=1,
                      model__lora__rank=4, trainer__kl_coef=0.1)
    return Trainer(cfg, trainer_mesh())


def test_only_adapters_get_gradients_and_optimizer_state(lora_trainer):
    base, adapters = lora.split(lora_trainer.params)
    batch = batch_of(trajectories(0, 2, 4), 4)
    _, grads = lora_trainer.loss_and_grads(batch)
    assert paths(grads) == paths(adapters)
    # With B = 0, A's gradient is zero and B's is not (the term is scale * B A x).
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert (np.abs(np.asarray(g)).max() > 0) == ("lora_b" in jax.tree_util.keystr(path))
    moments = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(
        lora_trainer.state.opt_state) if x.ndim]
    assert len(moments) == 2 * len(paths(adapters))
    assert all("lora_" in p for p in moments)
    assert lora.tree_bytes(lora_trainer.state.opt_state) < lora.tree_bytes(base) / 5


def test_lora_steps_lower_the_loss_and_keep_the_base(lora_trainer, tmp_path):
    """On one fixed batch; the KL reference is the base: 0 before any update."""
    before = jax.tree.map(np.asarray, lora_trainer.params)
    batch = batch_of(trajectories(0, 2, 4), 4)
    metrics = [jax.device_get(lora_trainer.train_step(batch)) for _ in range(4)]
    assert lora_trainer.ref_params is None
    assert metrics[0]["kl_ref"] == 0.0 and metrics[-1]["kl_ref"] > 0.0
    assert metrics[-1]["pg_loss"] < metrics[0]["pg_loss"] - 0.05
    base0, ad0 = lora.split(before)
    base1, ad1 = lora.split(lora_trainer.params)
    for a, b in zip(jax.tree.leaves(base0), jax.tree.leaves(base1)):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(ad0),
                                                        jax.tree.leaves(ad1)))
    # A checkpoint holds the base once and the adapters, and restores them.
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(4, lora_trainer.state, force=True)
        saved = paths(ckpt.saved_tree())
        state, _ = ckpt.restore(lora_trainer.abstract_state())
    assert sum("['attn']['wq']" in p for p in saved) == 1
    assert any(p.startswith("['params']") and "['lora_q']['lora_b']" in p for p in saved)
    assert any(p.startswith("['opt_state']") and "['lora_q']['lora_b']" in p for p in saved)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(lora_trainer.state)):
        np.testing.assert_array_equal(a, b)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.slow
def test_lora_sharded_step_matches_unsharded(load_config):
    """Expert adapters, capacity dispatch, 2 updates x 2 micro-batches, TIS, KL to the
    base, weight decay: one step on one device and on fsdp2 x tensor2 x expert2."""
    cfg = load_config("configs/moe.py:tiny", num_devices=len(jax.devices()),
                      model__num_layers=1, model__moe__dispatch="capacity",
                      model__moe__capacity_factor=2.0, model__lora__rank=4,
                      model__lora__experts=True, trainer__num_minibatches=2,
                      trainer__micro_batches=2, trainer__objective="tis", trainer__is_cap=1.5,
                      trainer__kl_coef=0.05, trainer__weight_decay=0.01)
    one = Trainer(cfg, trainer_mesh())
    sharded = Trainer(cfg, trainer_mesh(fsdp=2, tensor=2, expert=2))
    start = jax.device_get(one.state)
    sharded.load_state(start)
    batch = batch_of(trajectories(2, num_groups=4, group_size=4), 4)
    m_one = jax.device_get(one.train_step(batch))
    m_sharded = jax.device_get(sharded.train_step(batch))
    lr = cfg.trainer.learning_rate
    for a, b in zip(_leaves(sharded.params), _leaves(one.params)):
        assert np.abs(a - b).max() < 0.1 * lr  # Adam on ~0 gradients: rounding noise
    for k in ("loss", "pg_loss", "kl_ref", "grad_norm", "load_balance_loss"):
        np.testing.assert_allclose(m_sharded[k], m_one[k], rtol=2e-4, atol=1e-6, err_msg=k)
    assert m_one["kl_ref"] > 0 and m_one["skipped_updates"] == 0
    (b0, a0), (b1, a1) = lora.split(start.params), lora.split(one.params)
    for x, y in zip(_leaves(b0), _leaves(b1)):
        np.testing.assert_array_equal(x, y)
    assert max(np.abs(x - y).max() for x, y in zip(_leaves(a0), _leaves(a1))) > 1e-4
    w = sharded.params["blocks"][0]["mlp"]["lora_up"]["lora_a"][...]
    assert w.sharding.spec == P(None, "expert", "fsdp", None)


def test_lora_packed_unscanned_remat_step(load_config):
    """Packed micro-batches by tokens, layers unrolled and rematerialised."""
    cfg = load_config("configs/tiny.py:spread", num_devices=len(jax.devices()), model__num_layers=1,
                      model__scan_layers=False, model__remat="full", model__lora__rank=2,
                      model__lora__targets=("v", "down"), trainer__tokens_per_microbatch=128)
    tr = Trainer(cfg, trainer_mesh(data=2, fsdp=2))
    start = jax.device_get(tr.params)
    m = jax.device_get(tr.train_step(batch_of(trajectories(3, 2, 4), 4)))
    assert np.isfinite(m["loss"]) and m["skipped_updates"] == 0
    (b0, a0), (b1, a1) = lora.split(start), lora.split(tr.params)
    assert [k for k in paths(a0) if "lora_b" in k] == [
        "['blocks'][0]['attn']['lora_v']['lora_b'].value",
        "['blocks'][0]['mlp']['lora_down']['lora_b'].value"]
    for x, y in zip(_leaves(b0), _leaves(b1)):
        np.testing.assert_array_equal(x, y)
    # Every B moves (A's gradient is zero while B is).
    assert all(np.abs(x - y).max() > 0 for k, x, y in zip(paths(a0), _leaves(a0), _leaves(a1))
               if "lora_b" in k)


@pytest.mark.parametrize("change, named", [
    (dict(rank=-1), "model.lora.rank"),
    (dict(rank=4, alpha=0.0), "model.lora.alpha"),
    (dict(rank=4, targets=("q", "ffn")), "model.lora.targets"),
    (dict(rank=4, targets=()), "model.lora.targets"),
    (dict(rank=4, targets=("q", "q")), "model.lora.targets"),
    (dict(rank=4, experts=True, targets=("q",)), "model.lora.experts"),
    (dict(rank=4, dtype="float16"), "model.lora.dtype"),
])
def test_config_errors_name_the_field(change, named, load_config):
    c = load_config("configs/moe.py:tiny", validate=False)
    c.model.lora.update(change)
    with pytest.raises(config_lib.ConfigError, match=rf"config\.{named}:"):
        config_lib.validate(c)


def test_expert_adapters_need_an_moe_model(load_config):
    c = load_config("configs/tiny.py:spread", validate=False)
    c.model.lora.update(dict(rank=4, experts=True))
    with pytest.raises(config_lib.ConfigError, match=r"config\.model\.lora\.experts: .*dense"):
        config_lib.validate(c)
    c.model.lora.experts = False
    assert config_lib.validate(c).model.lora.scale == 32.0 / 4


QWEN3_8B = ModelConfig(vocab_size=151_936, d_model=4096, num_layers=36, num_heads=32,
                       num_kv_heads=8, head_dim=128, mlp_hidden=12_288,
                       param_dtype="bfloat16", dtype="bfloat16", rope_theta=1e6)


@pytest.mark.slow
def test_publish_bytes_of_adapters_are_a_small_fraction(load_config):
    """Rank 32 on every projection: Qwen3-8B (bf16 weights, f32 adapters) and
    Qwen3-30B-A3B (configs/moe.py, f32 weights) publish <= 3% of their weights' bytes."""
    moe30 = load_config("configs/moe.py").model
    q8 = tf.publish_bytes(with_lora(QWEN3_8B, rank=32))
    assert q8["full"] == 2 * 8_190_735_360  # bf16 x 8.19B parameters
    # 36 layers x (q, k, v, o, gate, up, down) x 32 ranks x (in + out), 4 bytes each.
    assert q8["adapters"] == 36 * 32 * 4 * (
        (4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 12_288) * 3)
    m30 = tf.publish_bytes(with_lora(moe30, rank=32))
    assert m30["full"] == 4 * 30_532_122_624  # every MLP is MoE: attention adapters only
    assert m30["adapters"] == 48 * 32 * 4 * ((2048 + 4096) * 2 + (2048 + 512) * 2)
    assert q8["ratio"] <= 0.03 and m30["ratio"] <= 0.03


def test_runs_start_from_checkpoint_bases_with_fresh_adapters(tiny_hf_checkpoint, load_config,
                                                               tmp_path):
    """A Hugging Face base, then an Orbax one (full fine-tuning's params): the base
    is read, the adapters are the seed's; saved adapters are read back; export
    folds them into the weights."""
    from dora_jax.model import hf
    from dora_jax.runtime.experiment import initial_params

    cfg = load_config("configs/qwen3_gsm8k.py:tiny", model__checkpoint=tiny_hf_checkpoint,
                      model__lora__rank=4)
    _, params = initial_params(cfg)
    base, adapters = lora.split(params)
    _, ours = hf.load_pretrained(tiny_hf_checkpoint, cfg=lora.base_config(cfg.model))
    _, fresh = lora.split(tf.create(cfg.model, cfg.seed)[1])
    for a, b in zip(_leaves(base) + _leaves(adapters), _leaves(ours) + _leaves(fresh)):
        np.testing.assert_array_equal(a, b)

    trained = randomise_b(params)
    out = str(tmp_path / "hf")
    hf.save_pretrained(cfg.model, trained, out)
    _, exported = hf.load_pretrained(out, cfg=lora.base_config(cfg.model))
    for a, b in zip(_leaves(exported), _leaves(lora.merged_weights(trained, cfg.model.lora))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

    for saved in (lora.merged_weights(trained, cfg.model.lora), trained):
        directory = tmp_path / f"init{len(paths(saved))}"
        with Checkpointer(directory, async_save=False) as ckpt:
            ckpt.save(1, saved, force=True)
        again = load_config("configs/qwen3_gsm8k.py:tiny", model__lora__rank=4,
                            init_checkpoint=str(directory))
        _, params = initial_params(again)
        want = saved if lora.has_adapters(saved) else lora.merge(saved, fresh)
        assert paths(params) == paths(want)
        for a, b in zip(_leaves(params), _leaves(want)):
            np.testing.assert_array_equal(a, b)


def test_sft_trains_the_adapters_alone(tmp_path, load_config):
    from _trainer_common import countdown_config

    from dora_jax import sft
    from dora_jax.model import hf_checks

    c = countdown_config(load_config)
    c.model.lora.update(dict(rank=8, targets=("q", "v", "up", "down")))
    cfg = hf_checks.validated(c, num_devices=8)
    out = sft.train(cfg, str(tmp_path), steps=12, batch_size=8, learning_rate=1e-2,
                    log_every=11)
    assert out["loss_last"] < 0.9 * out["loss_first"], out
    _, init = tf.create(cfg.model, cfg.seed)
    with Checkpointer(out["checkpoint"], async_save=False) as ckpt:
        saved, _ = ckpt.restore(init)
    (b0, a0), (b1, a1) = lora.split(init), lora.split(saved)
    for x, y in zip(_leaves(b0), _leaves(b1)):
        np.testing.assert_array_equal(x, y)
    assert paths(a1) == paths(a0) and any(
        not np.array_equal(x, y) for x, y in zip(_leaves(a0), _leaves(a1)))


@pytest.mark.slow
def test_a_lora_run_publishes_adapted_params_to_the_slices(small_config, tmp_path):
    """End to end (sync: every step trains on its own version's samples): the
    slices decode the trainer's adapted params, and each publish carries the
    adapters alone (metrics.jsonl's publish_bytes, the summary's)."""
    from conftest import audit_workdir

    from dora_jax.runtime import experiment

    c = small_config("sync", validate=False)
    c.model.lora.rank = 4
    cfg = config_lib.validate(c, num_devices=8)
    summary = experiment.run(cfg, str(tmp_path))
    _, report = audit_workdir(cfg, str(tmp_path))
    assert report.ok and summary["steps"] == cfg.coordinator.num_steps
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    sizes = tf.publish_bytes(cfg.model)
    assert {r["publish_bytes"] for r in records} == {sizes["adapters"]}
    assert sizes["adapters"] < sizes["full"] / 10
    assert summary["publish_bytes"] == sizes["adapters"]
    metrics = [r["trainer"] for r in records]
    # After the adapters moved, the engine's log-probs of its tokens are the trainer's.
    assert all(m["logprob_mismatch_tokens"] > 0 for m in metrics[1:])
    assert all(m["logprob_mismatch"] < 1e-3 for m in metrics)


def test_an_engine_places_a_frozen_base_once():
    """A version's base and adapters placed on a decode mesh: the next version, given
    the same base arrays, moves its adapters alone, and decodes as the merged model."""
    from dora_jax.rollout.placement import ParamPlacement

    cfg = with_lora(DENSE)
    graphdef, params = tf.create(cfg, 0)
    base, adapters = lora.split(jax.device_get(params))
    mesh = Mesh(np.asarray(jax.devices()[1:2]).reshape(1, 1), ("tensor", "expert"))
    placement = ParamPlacement(cfg, mesh, ())
    placement.place(lora.merge(base, adapters))
    assert placement.last_bytes == lora.tree_bytes(params)
    later = randomise_b(lora.merge(base, adapters))
    placed = placement.place(lora.merge(base, lora.split(later)[1]))
    assert placement.last_bytes == lora.tree_bytes(adapters) < lora.tree_bytes(base)
    # laid out for decoding: every layer apart (the model scans its stacked layers)
    assert cfg.scan_layers and placement.graphdef != graphdef
    tree = jax.tree.unflatten(placement.treedef, list(placed.leaves))
    np.testing.assert_allclose(tf.apply(placement.graphdef, tree, TOKENS)[0],
                               tf.apply(graphdef, later, TOKENS)[0], atol=1e-6)
