"""Hugging Face checkpoints: logits parity with the reference implementation's
(tests/fixtures/hf: logits transformers computed for tiny random checkpoints),
KV-cache decoding of loaded models, shard-by-shard placement, save -> load round
trips (and transformers reading what we write, where it is installed), and errors
that name what is wrong."""

import dataclasses
import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import reference as reference_module
from jax.sharding import Mesh

from dora_jax.config import TRAINER_RULES
from dora_jax.model import hf, hf_config, safetensors_file
from dora_jax.model import transformer as tf
from dora_jax.model.sharding import param_shardings

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hf"
FAMILIES = ["qwen3", "qwen3_tied", "qwen3_moe", "qwen2", "llama3"]


def reference(name):
    d = FIXTURES / name
    return np.load(d / "tokens.npy"), np.load(d / "logits.npy")


def logits_of(cfg, params, tokens):
    graphdef, _ = tf.abstract_params(cfg)
    logits, _, _ = tf.apply(graphdef, params, jnp.asarray(tokens), dropless=True)
    return np.asarray(logits)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("scan", [True, False])
def test_logits_match_the_reference_implementation(name, scan):
    cfg = hf.config_from_checkpoint(str(FIXTURES / name), scan_layers=scan)
    cfg, params = hf.load_pretrained(str(FIXTURES / name), cfg=cfg)
    tokens, expected = reference(name)
    np.testing.assert_allclose(logits_of(cfg, params, tokens), expected, atol=1e-4, rtol=0)


def test_each_family_exercises_its_feature():
    """The configs read from the fixtures carry what each family needs (a parity
    test cannot pass by ignoring a feature the checkpoint has)."""
    c = {n: hf.config_from_checkpoint(str(FIXTURES / n)) for n in FAMILIES}
    assert c["qwen3"].qk_norm and not c["qwen3"].tie_embeddings and c["qwen3"].head_dim == 20
    assert c["qwen3_tied"].tie_embeddings
    assert c["qwen3_moe"].moe.num_experts == 6 and c["qwen3_moe"].moe.top_k == 2
    assert c["qwen2"].qkv_bias and not c["qwen2"].qk_norm and c["qwen2"].tie_embeddings
    assert c["llama3"].rope_scaling == "llama3" and c["llama3"].rope_original_max_len == 64


@pytest.mark.parametrize("feature", ["rope_scaling", "qkv_bias"])
def test_parity_needs_the_feature(feature):
    """Loading the same weights while ignoring the feature breaks parity: the
    reference is sensitive to it."""
    name = {"rope_scaling": "llama3", "qkv_bias": "qwen2"}[feature]
    cfg, params = hf.load_pretrained(str(FIXTURES / name))
    tokens, expected = reference(name)
    if feature == "rope_scaling":
        wrong = dataclasses.replace(cfg, rope_scaling="none")
    else:
        wrong = cfg
        for b in ("bq", "bk", "bv"):
            bias = params["blocks"][0]["attn"][b]
            bias[...] = jnp.zeros_like(bias[...])
    assert np.abs(logits_of(wrong, params, tokens) - expected).max() > 1e-2


@pytest.mark.parametrize("name", ["qwen2", "llama3", "qwen3_moe"])
def test_kv_cache_decoding_of_a_loaded_model_equals_the_full_forward(name):
    cfg, params = hf.load_pretrained(str(FIXTURES / name))
    tokens, expected = reference(name)
    tokens, expected = tokens[:, :40], expected[:, :40]
    graphdef, _ = tf.abstract_params(cfg)
    B, T = tokens.shape
    cache = tf.init_cache(cfg, B, T)
    step = jax.jit(lambda p, t, pos, c: tf.decode(graphdef, p, t, pos, c))
    for t in range(T):
        logits, cache = step(params, jnp.asarray(tokens[:, t]), jnp.full((B,), t), cache)
        np.testing.assert_allclose(np.asarray(logits), expected[:, t], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_sharded_load_places_each_shard_and_keeps_the_logits(name):
    devices = np.array(jax.devices()[:8]).reshape(1, 4, 1, 2)  # vocab 61 is odd: no tensor axis
    mesh = Mesh(devices, ("data", "fsdp", "tensor", "expert"))
    cfg, params = hf.load_pretrained(str(FIXTURES / name), mesh=mesh, rules=TRAINER_RULES)
    want = param_shardings(tf.abstract_params(cfg)[1], mesh, TRAINER_RULES)
    split = 0
    for x, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
        assert x.sharding.is_equivalent_to(sharding, x.ndim)
        shard_shape = x.addressable_shards[0].data.shape
        split += shard_shape != x.shape
    assert split >= 10  # the embedding, projections and experts really are cut
    _, unsharded = hf.load_pretrained(str(FIXTURES / name))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(unsharded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens, expected = reference(name)
    np.testing.assert_allclose(logits_of(cfg, params, tokens), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_save_writes_back_the_same_tensors(name, tmp_path):
    cfg, params = hf.load_pretrained(str(FIXTURES / name))
    hf.save_pretrained(cfg, params, str(tmp_path))
    original = safetensors_file.Checkpoint(str(FIXTURES / name))
    saved = safetensors_file.Checkpoint(str(tmp_path))
    assert saved.names == original.names
    for n in original.names:
        np.testing.assert_array_equal(saved.get(n), original.get(n), err_msg=n)
    again = hf.config_from_checkpoint(str(tmp_path))
    assert [f for f in hf_config.ARCH_FIELDS if getattr(again, f) != getattr(cfg, f)] == []
    assert [f for f in hf_config.MOE_ARCH_FIELDS
            if getattr(again.moe, f) != getattr(cfg.moe, f)] == []


def test_sharded_files_and_bfloat16_round_trip(tmp_path):
    cfg, params = hf.load_pretrained(str(FIXTURES / "qwen3_moe"))
    files = hf.save_pretrained(cfg, params, str(tmp_path), dtype="bfloat16",
                               max_shard_bytes=50_000)
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    cfg16, params16 = hf.load_pretrained(str(tmp_path))
    assert cfg16.param_dtype == "bfloat16"
    for a, b in zip(jax.tree.leaves(params16), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)))


def _broken_copy(tmp_path, name="qwen3"):
    d = tmp_path / name
    shutil.copytree(FIXTURES / name, d)
    return d


def test_errors_name_what_is_wrong(tmp_path):
    d = _broken_copy(tmp_path)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(hf.CheckpointError, match="model_type 'gpt2'"):
        hf.load_pretrained(str(d))
    (d / "config.json").write_text(json.dumps({**config, "use_sliding_window": True}))
    with pytest.raises(hf.CheckpointError, match="use_sliding_window"):
        hf.load_pretrained(str(d))
    (d / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    with pytest.raises(hf.CheckpointError,
                       match=r"mlp\.\w+_proj\.weight' has shape \((80, 48|48, 80)\), "
                             r"the config needs"):
        hf.load_pretrained(str(d))
    with pytest.raises(hf.CheckpointError, match="no such checkpoint directory"):
        hf.load_pretrained(str(tmp_path / "nowhere"))


def test_missing_and_unused_tensors_are_named(tmp_path):
    cfg, params = hf.load_pretrained(str(FIXTURES / "qwen3"))
    tied = dataclasses.replace(cfg, tie_embeddings=True)
    with pytest.raises(hf.CheckpointError, match="lm_head.weight"):  # unused by a tied model
        hf.load_pretrained(str(FIXTURES / "qwen3"), cfg=tied)
    untied = dataclasses.replace(hf.config_from_checkpoint(str(FIXTURES / "qwen3_tied")),
                                 tie_embeddings=False)
    with pytest.raises(hf.CheckpointError, match="missing tensor 'lm_head.weight'"):
        hf.load_pretrained(str(FIXTURES / "qwen3_tied"), cfg=untied)


def test_older_hub_field_names_are_read():
    modern = hf_config.read(str(FIXTURES / "qwen3_moe"))
    legacy = {k: v for k, v in modern.items() if k not in ("rope_parameters", "num_local_experts")}
    legacy.update(rope_theta=1_000_000.0, num_experts=6)
    assert hf_config.model_fields(legacy) == hf_config.model_fields(modern)
    llama = hf_config.read(str(FIXTURES / "llama3"))
    scaling = dict(llama.pop("rope_parameters"))
    old_llama = {**llama, "rope_theta": scaling.pop("rope_theta"), "rope_scaling": scaling}
    assert hf_config.model_fields(old_llama) == hf_config.model_fields(
        hf_config.read(str(FIXTURES / "llama3")))


@pytest.mark.parametrize("name", FAMILIES)
def test_transformers_reads_what_we_save(name, tmp_path):
    """The reference implementation loads our saved checkpoint (after we loaded and
    re-saved it) and computes the logits we compute."""
    torch = reference_module("torch")
    transformers = reference_module("transformers")
    cfg, params = hf.load_pretrained(str(FIXTURES / name))
    hf.save_pretrained(cfg, params, str(tmp_path))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, attn_implementation="eager")
    tokens, expected = reference(name)
    with torch.no_grad():
        theirs = model(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(theirs, logits_of(cfg, params, tokens), atol=1e-4, rtol=0)
    np.testing.assert_allclose(theirs, expected, atol=1e-4, rtol=0)
    assert os.path.exists(tmp_path / "generation_config.json")
