"""Slices decode from per-layer params and per-layer KV buffers (model/layer_layout.py):
a version is laid out once, when placed; the compiled decode step then copies no
weight and no cache, and accesses about the weights once plus the KV."""

import dataclasses

import _rollout_common as rc
import jax
import jax.numpy as jnp
import numpy as np

from dora_jax.model import layer_layout
from dora_jax.model import transformer as tf
from dora_jax.rollout import hlo_cost
from dora_jax.rollout.engine import Engine
from dora_jax.rollout.state import EngineParams
from dora_jax.rollout.step_cost import step_cost


def _weight_shapes(leaves) -> set:
    """Shapes of the weights (a norm's scale is too small to matter)."""
    return {tuple(x.shape) for x in leaves if np.prod(x.shape) >= 256}


def _written(compiled, shapes: set) -> dict:
    return {name: s for name, s in hlo_cost.arrays_written(compiled.as_text()).items()
            if set(s) & shapes}


def _view(eng: Engine, full: bool):
    """The engine's page view (None: dense); `full`: every slot's pages mapped, which
    the default pool reads in place."""
    if eng.pages is None:
        return None
    if full:
        for slot in range(eng.max_concurrent_decodes):
            eng.pages.assign(slot, eng.cache_length)
        assert eng.pages.view().page_slots.size
    return eng.pages.view()


def test_a_placed_version_is_its_layers_apart():
    """The model scans stacked layers; the slice holds each layer's arrays apart,
    the same numbers, laid out once."""
    cfg = rc.config("dense").model
    assert cfg.scan_layers and cfg.num_layers == 2
    _, params = tf.create(cfg, 3)
    eng = Engine(cfg, rc.rollout(1, "dense"), rc.meshes()[1][0])
    placed = eng.load_params(params)
    stacked = params["blocks"][0]["attn"]["wq"][...]
    tree = jax.tree.unflatten(eng.placement.treedef, list(placed.leaves))
    for layer in range(cfg.num_layers):
        np.testing.assert_array_equal(tree["blocks"][layer]["attn"]["wq"][...], stacked[layer])
    assert len(placed.leaves) > len(jax.tree.leaves(params))
    want = [np.asarray(x) for x in jax.tree.leaves(layer_layout.unstack(cfg, params))]
    assert all(np.array_equal(a, b) for a, b in zip(placed.leaves, want, strict=True))


def test_params_on_an_accelerator_are_cut_into_layers_on_the_mesh(monkeypatch):
    """Device arrays (an accelerator's; here CPU arrays taken down that path) move in
    their stacked layout, in chunks, and one program per set of leaves cuts them:
    the same arrays as the host path's, with the decode shardings."""
    from dora_jax.rollout import placement as placement_lib

    cfg = rc.config("dense").model
    _, params = tf.create(cfg, 5)
    eng = Engine(cfg, rc.rollout(1, "dense"), rc.meshes()[1][0])
    on_host = eng.load_params(jax.device_get(params))
    sources = [jax.tree.leaves(params)[s.leaf] for s in layer_layout.sources(cfg)]
    monkeypatch.setattr(placement_lib, "CHUNK_BYTES", 4096)  # several chunks
    cut = eng.placement._cut_on_mesh(sources, list(range(len(sources))))
    assert len(eng.placement._cutters) > 1
    for i, x in enumerate(on_host.leaves):
        assert cut[i].sharding == x.sharding
        np.testing.assert_array_equal(cut[i], x)


def test_the_decode_step_copies_no_weight():
    """No instruction of the optimised step writes an array shaped as a weight; the
    same check finds the copies that decoding from the stacked params makes (each
    layer's weights sliced out of the stack), so it can fail."""
    cfg = rc.config("dense").model
    rollout = dataclasses.replace(rc.rollout(1, "dense"), slots_per_slice=3)
    _, params = tf.create(cfg, 0)
    for kv, full in (("dense", False), ("paged", False), ("paged", True)):
        eng = Engine(cfg, dataclasses.replace(rollout, kv_cache=kv), rc.meshes()[1][0])
        placed = eng.load_params(params)
        shapes = _weight_shapes(placed.leaves)
        _view(eng, full)
        assert not _written(eng.compiled_step(placed), shapes), kv

    graphdef, _ = tf.abstract_params(cfg)  # the model's own, stacked layout
    stacked_step = jax.jit(lambda p, t, pos, c: tf.decode(graphdef, p, t, pos, c),
                           donate_argnums=3)
    tokens = jnp.zeros(3, jnp.int32)
    copies = _written(stacked_step.lower(params, tokens, tokens, tf.init_cache(cfg, 3, 16))
                      .compile(), shapes)
    assert len(copies) >= cfg.num_layers, copies


def test_the_kv_cache_is_written_in_place():
    """The donated cache: each layer's buffer takes one token per slot where it lies
    (no instruction writes a buffer-sized array, the step needs no scratch of a
    buffer's size). Not donated, XLA must copy every buffer first: the check sees it."""
    cfg = rc.config("dense").model
    rollout = dataclasses.replace(rc.rollout(1, "dense"), slots_per_slice=3, max_decode_len=500,
                                  page_size=16)
    for kv, full in (("dense", False), ("paged", False), ("paged", True)):
        eng = Engine(cfg, dataclasses.replace(rollout, kv_cache=kv), rc.meshes()[1][0])
        placed = eng.load_params(tf.create(cfg, 0)[1])
        state = jax.eval_shape(eng.init_decode_state)
        view = _view(eng, full)
        buffer = state.cache.k[0]
        assert len(state.cache.k) == cfg.num_layers
        step = eng.compiled_step(placed)
        assert not _written(step, {buffer.shape}), kv
        assert step.memory_analysis().temp_size_in_bytes < buffer.size * buffer.dtype.itemsize
        copying = jax.jit(eng.generate_fn).lower(placed, state, view).compile()
        assert len(_written(copying, {buffer.shape})) >= 2 * cfg.num_layers, kv


def test_a_decode_step_accesses_its_weights_once_and_its_kv():
    """At a shape where weights and KV outweigh activations (d_model 1024, 4 layers,
    64 slots of 508 positions, f32; abstract params, nothing allocated), a step
    accesses (hlo_cost: loops by their trip counts, updates in place by their
    updates) within 1.3x of the weights once plus the KV cache, and at least them:
    the dense cache, and the paged one with every slot's pages mapped (pages of 64),
    whose pool `auto` then reads in place. Gathering the mapped pages instead
    (`ragged`) copies them first, and the check sees it."""
    base = rc.config("dense").model
    cfg = dataclasses.replace(base, vocab_size=4096, d_model=1024, num_layers=4, num_heads=8,
                              num_kv_heads=4, head_dim=128, mlp_hidden=2816)
    ratios = {}
    for kv, impl in (("dense", "auto"), ("paged", "auto"), ("paged", "ragged")):
        rollout = dataclasses.replace(rc.rollout(1, kv), slots_per_slice=64, max_decode_len=500,
                                      page_size=64, paged_attention=impl)
        eng = Engine(cfg, rollout, rc.meshes()[1][0])
        abstract = EngineParams(tuple(
            jax.ShapeDtypeStruct(shape, dtype, sharding=sh) for (shape, dtype), sh in zip(
                eng.placement.leaf_shapes, eng.placement.shardings.leaves)))
        if eng.pages is not None:
            for slot in range(64):
                eng.pages.assign(slot, eng.cache_length)
        cost = step_cost(eng, abstract)
        if eng.pages is not None:  # counting the step left the pool as it was
            assert eng.pages.num_used == 64 * eng.pages.pages_per_slot
        assert cost["weight_bytes"] == 4 * tf.count_params(tf.abstract_params(cfg)[1])
        pool_positions = 64 * eng.cache_length if kv == "dense" else (
            (eng.pages.num_pages + 1) * 64)
        assert cost["kv_bytes"] == 2 * 4 * pool_positions * 4 * 128 * 4
        ratios[kv, impl] = cost["bytes_accessed"] / cost["ideal_bytes"]
    assert 1.0 <= ratios["dense", "auto"] <= 1.3, ratios
    assert 1.0 <= ratios["paged", "auto"] <= 1.3, ratios
    assert ratios["paged", "ragged"] > 2, ratios
