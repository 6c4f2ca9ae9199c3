"""LoRA adapters in PEFT's format (model/peft_format.py), checked against the real
`peft` on torch: our adapters exported and loaded by `PeftModel.from_pretrained` on
the Hugging Face base compute our logits (and `merge_and_unload` our merged export's);
a PeftModel's saved adapter imported into ours computes its logits; ours -> PEFT ->
ours is bit-exact; and a directory that is not what we read fails naming what."""

import copy
import dataclasses
import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import reference

from dora_jax.config.model import LoRAConfig
from dora_jax.model import hf, lora, peft_format, safetensors_file
from dora_jax.model import transformer as tf

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hf"
ALL = ("q", "k", "v", "o", "gate", "up", "down")
# Llama (GQA, llama3 RoPE) and Qwen3 (q/k norms) with every target; Qwen3-MoE's
# attention (its experts' adapters have no PEFT form: peft_format's docstring).
FAMILIES = {"llama3": ALL, "qwen3": ALL, "qwen3_moe": ("q", "k", "v", "o")}
RANK, ALPHA, T = 4, 8.0, 24


def tokens():
    return np.load(FIXTURES / "llama3" / "tokens.npy")[:, :T] % 61


def adapted(name, *, scan=True, seed=0, targets=None):
    """(cfg, params): the fixture's base with random non-zero adapters."""
    base_cfg = hf.config_from_checkpoint(str(FIXTURES / name), dtype="float32",
                                         scan_layers=scan)
    cfg = dataclasses.replace(base_cfg, lora=LoRAConfig(rank=RANK, alpha=ALPHA,
                                                        targets=targets or FAMILIES[name]))
    _, base = hf.load_pretrained(str(FIXTURES / name), cfg=base_cfg)
    adapters = tf.init_adapters(cfg, seed)
    leaves, treedef = jax.tree_util.tree_flatten(adapters)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [0.3 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    return cfg, lora.merge(base, jax.tree_util.tree_unflatten(treedef, leaves))


def our_logits(cfg, params, toks):
    graphdef, _ = tf.abstract_params(cfg)
    logits, _, _ = tf.apply(graphdef, params, jnp.asarray(toks), dropless=True)
    return np.asarray(logits)


def torch_logits(model, toks):
    torch = reference("torch")
    with torch.no_grad():
        return model(torch.tensor(toks)).logits.numpy()


def hf_base(path):
    torch, transformers = reference("torch"), reference("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_peft_loads_our_adapters_and_computes_our_logits(name, tmp_path):
    peft = reference("peft")
    cfg, params = adapted(name)
    files = peft_format.save_adapters(cfg, params, str(tmp_path / "adapter"),
                                      base_model_name_or_path=str(FIXTURES / name))
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    if name == "llama3":  # the base found by base_model_name_or_path, as users load it
        model = peft.AutoPeftModelForCausalLM.from_pretrained(
            str(tmp_path / "adapter"), dtype=reference("torch").float32,
            attn_implementation="eager")
    else:
        model = peft.PeftModel.from_pretrained(hf_base(FIXTURES / name),
                                               str(tmp_path / "adapter"))
    toks = tokens()
    ours = our_logits(cfg, params, toks)
    base_only = our_logits(cfg, lora.zero_adapters(params), toks)
    assert np.abs(ours - base_only).max() > 1e-2  # the adapters change the logits
    theirs = torch_logits(model, toks)
    # Against the exact logits (PEFT's model in float64): ours in float32 as accurate
    # as PEFT's own float32 within a small factor. A fixed tolerance on ours - theirs
    # would not hold: with other random adapters (or another CPU's code generation)
    # PEFT's own float32 error alone reaches 1e-4.
    try:
        exact = torch_logits(copy.deepcopy(model).double(), toks)
    except RuntimeError:  # transformers' grouped MoE matmul has no float64: PEFT's as is
        exact, reference_error = theirs, 1e-4 / 3
    else:
        reference_error = np.abs(theirs - exact).max()
        assert 0 < reference_error < 1e-3
    assert np.abs(ours - exact).max() <= 3 * reference_error

    # Our merged export is what PEFT's merge_and_unload computes.
    hf.save_pretrained(cfg, params, str(tmp_path / "merged"))
    merged = torch_logits(hf_base(tmp_path / "merged"), toks)
    unloaded = torch_logits(model.merge_and_unload(), toks)
    for logits in (merged, unloaded):
        assert np.abs(logits - exact).max() <= 3 * reference_error


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_we_import_a_peft_models_adapter_and_compute_its_logits(name, tmp_path):
    torch, peft = reference("torch"), reference("peft")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=[
        peft_format.HF_MODULE[t] for t in ALL], task_type="CAUSAL_LM",
        init_lora_weights=False)  # A and B both random: the adapter is not a no-op
    model = peft.get_peft_model(hf_base(FIXTURES / name), config)
    model.save_pretrained(str(tmp_path))
    toks = tokens()
    theirs = torch_logits(model, toks)
    for scan in (True, False):
        cfg, params = adapted(name, scan=scan)
        params = lora.merge(lora.split(params)[0], peft_format.load_adapters(str(tmp_path), cfg))
        np.testing.assert_allclose(our_logits(cfg, params, toks), theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("scan", [True, False])
def test_round_trip_is_bit_exact(name, scan, tmp_path):
    cfg, params = adapted(name, scan=scan)
    peft_format.save_adapters(cfg, params, str(tmp_path))
    back = peft_format.load_adapters(str(tmp_path), cfg)
    want = lora.split(params)[1]
    assert jax.tree.structure(back) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(want)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Read into the other layout (scanned or not) and written again: the same file.
    other_cfg = dataclasses.replace(cfg, scan_layers=not scan)
    other = lora.merge(lora.split(tf.create(other_cfg, 1)[1])[0],
                       peft_format.load_adapters(str(tmp_path), other_cfg))
    peft_format.save_adapters(other_cfg, other, str(tmp_path / "other"))
    assert (tmp_path / "other" / "adapter_model.safetensors").read_bytes() == \
        (tmp_path / "adapter_model.safetensors").read_bytes()


def test_the_files_are_named_as_peft_writes_them(tmp_path):
    cfg, params = adapted("llama3")
    peft_format.save_adapters(cfg, params, str(tmp_path), base_model_name_or_path="base")
    f = safetensors_file.SafetensorsFile(str(tmp_path / "adapter_model.safetensors"))
    c = cfg  # q: [H*Dh, D] -> A [r, D], B [H*Dh, r]; k: [K*Dh, D]; o's input is H*Dh
    pre = "base_model.model.model.layers.1."
    assert f.info(pre + "self_attn.q_proj.lora_A.weight").shape == (RANK, c.d_model)
    assert f.info(pre + "self_attn.q_proj.lora_B.weight").shape == (
        c.num_heads * c.head_dim, RANK)
    assert f.info(pre + "self_attn.k_proj.lora_B.weight").shape == (
        c.num_kv_heads * c.head_dim, RANK)
    assert f.info(pre + "self_attn.o_proj.lora_A.weight").shape == (
        RANK, c.num_heads * c.head_dim)
    assert f.info(pre + "mlp.down_proj.lora_A.weight").shape == (RANK, c.mlp_hidden)
    assert len(f.names) == 2 * 7 * c.num_layers
    written = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (written["r"], written["lora_alpha"], written["base_model_name_or_path"]) == (
        RANK, 8, "base")
    assert written["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                         "up_proj", "down_proj"]


# ------------------------------------------------------------------ what is refused

@pytest.fixture
def saved(tmp_path):
    cfg, params = adapted("qwen3")
    d = tmp_path / "adapter"
    peft_format.save_adapters(cfg, params, str(d))
    return cfg, d


def _edit_config(d, **fields):
    c = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**c, **fields}))


@pytest.mark.parametrize("field,change,match", [
    ("model.lora.rank", dict(r=8), r"config.model.lora.rank: 4, but adapter .* has r 8"),
    ("model.lora.alpha", dict(lora_alpha=16), r"config.model.lora.alpha: 8.0, but .* 16"),
    ("model.lora.targets", dict(target_modules=["q_proj", "v_proj"]),
     r"config.model.lora.targets: .* targets \('q', 'v'\)"),
])
def test_rank_alpha_and_targets_must_match_the_config(saved, field, change, match):
    cfg, d = saved
    _edit_config(d, **change)
    with pytest.raises(peft_format.PeftFormatError, match=match) as e:
        peft_format.load_adapters(str(d), cfg)
    assert e.value.field == field


@pytest.mark.parametrize("change,match", [
    (dict(use_dora=True), "use_dora = True changes what the adapter computes"),
    (dict(use_rslora=True), "use_rslora"),
    (dict(rank_pattern={"q_proj": 8}), "rank_pattern"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(bias="all"), "bias = 'all'"),
    (dict(peft_type="IA3"), "peft_type 'IA3'"),
    (dict(target_modules="^.*proj$"), "a regular expression is not read"),
    (dict(target_modules=["q_proj", "lm_head"]), r"target_modules \['lm_head'\] have no adapter"),
    (dict(r=True), "r must be a positive integer"),
])
def test_options_we_do_not_compute_are_refused(saved, change, match):
    cfg, d = saved
    _edit_config(d, **change)
    with pytest.raises(peft_format.PeftFormatError, match=match):
        peft_format.load_adapters(str(d), cfg)


def _rewrite_tensors(d, edit):
    path = str(d / "adapter_model.safetensors")
    f = safetensors_file.SafetensorsFile(path)
    tensors = edit({n: np.array(f.get(n)) for n in f.names})
    del f
    safetensors_file.write(path, [safetensors_file.TensorSpec(n, x.shape, x.dtype,
                                                              lambda x=x: x)
                                  for n, x in tensors.items()])


NAME = "base_model.model.model.layers.2.mlp.up_proj.lora_B.weight"


@pytest.mark.parametrize("edit,match", [
    (lambda t: {n: x for n, x in t.items() if n != NAME}, f"missing tensor '{NAME}'"),
    (lambda t: {**t, NAME: t[NAME][:-1]}, rf"'{NAME}' has shape \(79, 4\), the config needs "
                                          r"\(80, 4\)"),
    (lambda t: {**t, NAME: t[NAME].astype(np.int32)}, "is int32, not float32, float16"),
    (lambda t: {**t, NAME: np.full_like(t[NAME], np.nan)}, "non-finite"),
    (lambda t: {**t, "base_model.model.lm_head.lora_A.weight": np.zeros((4, 48), np.float32)},
     "1 tensors the model has no adapter for: base_model.model.lm_head"),
])
def test_tensors_are_checked_by_name_shape_and_dtype(saved, edit, match):
    cfg, d = saved
    _rewrite_tensors(d, edit)
    with pytest.raises(peft_format.PeftFormatError, match=match):
        peft_format.load_adapters(str(d), cfg)


def test_untrusted_directories_fail_in_one_line(saved, tmp_path):
    cfg, d = saved
    with pytest.raises(peft_format.PeftFormatError, match="no such adapter directory"):
        peft_format.load_adapters(str(tmp_path / "nowhere"), cfg)
    os.remove(d / "adapter_model.safetensors")
    (d / "adapter_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(peft_format.PeftFormatError, match="a pickle, which is never read"):
        peft_format.load_adapters(str(d), cfg)
    outside = tmp_path / "elsewhere.json"
    shutil.move(d / "adapter_config.json", outside)
    os.symlink(outside, d / "adapter_config.json")
    with pytest.raises(peft_format.PeftFormatError, match="outside"):
        peft_format.load_adapters(str(d), cfg)
    os.remove(d / "adapter_config.json")
    os.mkfifo(d / "adapter_config.json")
    with pytest.raises(peft_format.PeftFormatError, match="a FIFO, not a regular file"):
        peft_format.load_adapters(str(d), cfg)


def test_experts_adapters_are_refused_for_export(tmp_path):
    base_cfg = hf.config_from_checkpoint(str(FIXTURES / "qwen3_moe"), dtype="float32")
    cfg = dataclasses.replace(base_cfg, lora=LoRAConfig(rank=RANK, alpha=ALPHA, experts=True))
    _, params = tf.create(cfg, 0)
    with pytest.raises(peft_format.PeftFormatError, match="no PEFT form") as e:
        peft_format.save_adapters(cfg, params, str(tmp_path))
    assert e.value.field == "model.lora.experts"


# ------------------------------------------------------------------ a run's config and export

def _run_config(load_config, checkpoint, **overrides):
    return load_config("configs/qwen3_gsm8k.py:tiny", model__checkpoint=checkpoint,
                       **{"model__lora__rank": RANK, "model__lora__alpha": ALPHA, **overrides})


def moved(params):
    """`params` with every adapter moved off its init (the base as it was)."""
    base, adapters = lora.split(params)
    return lora.merge(base, jax.tree.map(lambda x: x + 0.25, adapters))


def test_a_run_warm_starts_from_a_peft_adapter(load_config, tiny_hf_checkpoint, tmp_path):
    from dora_jax import config as config_lib
    from dora_jax.runtime.experiment import initial_params

    cfg = _run_config(load_config, tiny_hf_checkpoint)
    _, params = initial_params(cfg)
    trained = moved(params)
    peft_format.save_adapters(cfg.model, trained, str(tmp_path / "adapter"))
    warm = _run_config(load_config, tiny_hf_checkpoint,
                       model__lora__checkpoint=str(tmp_path / "adapter"))
    _, started = initial_params(warm)
    base, adapters = lora.split(started)
    for a, b in zip(jax.tree.leaves(adapters), jax.tree.leaves(lora.split(trained)[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(lora.split(params)[0])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the base: model.checkpoint's

    # Validation reads adapter_config.json and names the field that disagrees.
    with pytest.raises(config_lib.ConfigError,
                       match=r"config.model.lora.rank: 8, but adapter .* has r 4"):
        _run_config(load_config, tiny_hf_checkpoint, model__lora__rank=8,
                    model__lora__checkpoint=str(tmp_path / "adapter"))
    with pytest.raises(config_lib.ConfigError,
                       match=r"config.model.lora.targets: \('q', 'v'\), but adapter"):
        _run_config(load_config, tiny_hf_checkpoint, model__lora__targets=("q", "v"),
                    model__lora__checkpoint=str(tmp_path / "adapter"))
    with pytest.raises(config_lib.ConfigError, match=r"config.model.lora.checkpoint: .* "
                                                     r"no adapter_config.json"):
        _run_config(load_config, tiny_hf_checkpoint, model__lora__checkpoint=str(tmp_path))
    with pytest.raises(config_lib.ConfigError, match=r"config.model.lora.checkpoint: starts "
                                                     r"adapters from a PEFT adapter"):
        _run_config(load_config, tiny_hf_checkpoint, model__lora__rank=0,
                    model__lora__checkpoint=str(tmp_path / "adapter"))


def test_export_writes_the_runs_adapters_in_peft_format(load_config, tiny_hf_checkpoint,
                                                         tmp_path):
    from dora_jax import export
    from dora_jax.config import devices
    from dora_jax.model.checkpointing import Checkpointer
    from dora_jax.rl.trainer import Trainer

    cfg = _run_config(load_config, tiny_hf_checkpoint)
    from dora_jax.runtime.experiment import initial_params

    graphdef, params = initial_params(cfg)
    trained = moved(params)
    trainer = Trainer(cfg, devices.make_meshes(cfg.mesh)[0], params=trained, graphdef=graphdef)
    with Checkpointer(str(tmp_path / "run" / "checkpoints"), async_save=False) as ckpt:
        ckpt.save(2, trainer.state, force=True)
    result = export.export(cfg, str(tmp_path / "run"), str(tmp_path / "adapter"), format="peft")
    assert result["step"] == 2 and result["base"] == tiny_hf_checkpoint
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["base_model_name_or_path"] == os.path.abspath(tiny_hf_checkpoint)
    assert (tmp_path / "adapter" / "tokenizer.json").exists()
    back = peft_format.load_adapters(str(tmp_path / "adapter"), cfg.model)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(lora.split(trained)[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # --base_out writes the run's (frozen) base beside them: model.checkpoint's tensors.
    export.export(cfg, str(tmp_path / "run"), str(tmp_path / "a2"), format="peft",
                  base_out=str(tmp_path / "base"))
    saved = safetensors_file.Checkpoint(str(tmp_path / "base"))
    original = safetensors_file.Checkpoint(tiny_hf_checkpoint)
    assert saved.names == original.names
    for n in original.names:
        np.testing.assert_array_equal(saved.get(n), original.get(n), err_msg=n)
    elsewhere = dataclasses.replace(cfg, init_checkpoint=str(tmp_path / "run" / "checkpoints"))
    with pytest.raises(peft_format.PeftFormatError, match="pass --base_out"):
        export.export(elsewhere, str(tmp_path / "run"), str(tmp_path / "a3"), format="peft")
