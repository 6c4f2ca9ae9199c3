"""Every shipped config parses and validates; invalid values fail naming the field."""

import dataclasses
import math
import os
import re

import pytest
from conftest import REPO

from dora_jax import config as config_lib
from dora_jax.model import hf_checks
from dora_jax.model import transformer as tf

CONFIG_FILES = sorted(str(p.relative_to(REPO)) for p in REPO.glob("configs/[!_]*.py"))


def _specs():
    for path in CONFIG_FILES:
        module_vars = {}
        exec((REPO / path).read_text().split("def get_config")[0], module_vars)
        for variant in module_vars["VARIANTS"]:
            yield path if variant is None else f"{path}:{variant}"


@pytest.mark.parametrize("spec", list(_specs()))
def test_shipped_config_validates(spec, load_config, request):
    # A config that takes its architecture from a checkpoint gets a tiny one.
    needs_checkpoint = spec == "configs/qwen3_gsm8k.py"
    overrides = ({"model__checkpoint": request.getfixturevalue("tiny_hf_checkpoint"),
                  "data__path": "train.jsonl"} if needs_checkpoint else {})
    cfg = load_config(spec, **overrides)
    assert cfg.model.vocab_size > 0
    doc = (REPO / spec.split(":")[0]).read_text()
    docstring = doc.split('"""')[1]
    assert f"python -m dora_jax.main --config={spec}" in docstring  # its run command
    assert "parameters" in docstring


def test_every_config_declares_variants_and_a_cpu_variant(load_config):
    assert CONFIG_FILES
    for path in CONFIG_FILES:
        assert "VARIANTS" in (REPO / path).read_text(), path
    # The flagship has a CPU-sized variant that fits 8 fake devices.
    load_config("configs/moe.py:tiny", num_devices=8)
    load_config("configs/tiny.py", num_devices=8)
    load_config("configs/tiny.py", num_devices=3)
    load_config(_spread, num_devices=8)


def _docstring_count(path, marker):
    doc = (REPO / path).read_text().split('"""')[1]
    counts = [int(m.replace(",", "")) for m in re.findall(r"([\d,]{5,}) parameters", doc)]
    return counts[marker]


def test_moe_param_count_matches_docstring_without_allocating(load_config):
    cfg = load_config("configs/moe.py").model
    _, params = tf.abstract_params(cfg)  # ShapeDtypeStructs only
    n = tf.count_params(params)
    # Independent count from the Qwen3-30B-A3B architecture, by hand:
    D, H, K, Dh, E, F, V, L = 2048, 32, 4, 128, 128, 768, 151_936, 48
    attention = 2 * D * H * Dh + 2 * D * K * Dh + 2 * Dh  # q, o, k, v, q/k norms
    layer = attention + 2 * D + D * E + E * 3 * D * F  # 2 norms, router, experts
    assert n == L * layer + 2 * V * D + D  # + embed, lm_head, final norm
    assert n == _docstring_count("configs/moe.py", 0)
    assert math.isclose(n, 30.5e9, rel_tol=0.005)  # the published "30.5B total"


@pytest.mark.parametrize("spec,index", [("configs/tiny.py", 0), ("configs/moe.py:tiny", 1)])
def test_tiny_param_counts_match_docstrings(spec, index, load_config):
    cfg = load_config(spec).model
    _, params = tf.abstract_params(cfg)
    assert tf.count_params(params) == _docstring_count(spec.split(":")[0], index)
    assert tf.count_params(params) < 1_000_000


_tiny, _moe_tiny = "configs/tiny.py", "configs/moe.py:tiny"
_spread = "configs/tiny.py:spread"  # the trainer on data=2 x fsdp=2, 4 slices
_multiturn_tiny = "configs/multiturn.py:tiny"


def _set(c, dotted, value):
    *path, leaf = dotted.split(".")
    node = c
    for p in path:
        node = node[p]
    node[leaf] = value
    return c


# (base, field to set, value, field named in the error)
INVALID = [
    (_tiny, "model.num_heads", 3, "model.num_heads"),  # does not divide d_model 64
    (_tiny, "model.num_kv_heads", 3, "model.num_kv_heads"),  # does not divide 4 heads
    (_tiny, "model.head_dim", 15, "model.head_dim"),  # odd: RoPE needs pairs
    (_tiny, "model.vocab_size", 0, "model.vocab_size"),
    (_tiny, "model.num_layers", -1, "model.num_layers"),
    (_tiny, "model.dtype", "float16", "model.dtype"),
    (_tiny, "model.rope_theta", 0.0, "model.rope_theta"),
    (_moe_tiny, "model.moe.top_k", 9, "model.moe.top_k"),  # > 8 experts
    (_moe_tiny, "model.moe.capacity_factor", 0.0, "model.moe.capacity_factor"),
    (_moe_tiny, "model.moe.expert_hidden", 0, "model.moe.expert_hidden"),
    (_moe_tiny, "model.moe.moe_every", 3, "model.moe.moe_every"),  # > 2 layers
    (_moe_tiny, "model.moe.shared_expert_hidden", 0, "model.moe.shared_expert_hidden"),
    (_moe_tiny, "mesh.trainer.expert", 3, "mesh.trainer.expert"),  # does not divide 8
    (_tiny, "mesh.trainer.tensor", 4, "mesh.trainer.tensor"),  # does not divide 2 kv heads
    (_tiny, "mesh.slice.tensor", 0, "mesh.slice.tensor"),
    (_tiny, "mesh.num_slices", 0, "mesh.num_slices"),
    (_tiny, "rollout.max_prefill_length", 64, "rollout.prefill_buckets"),  # > largest bucket
    (_tiny, "rollout.temperature", 0.0, "rollout.temperature"),
    (_tiny, "rollout.top_p", 1.5, "rollout.top_p"),
    (_tiny, "rollout.eos_id", 128, "rollout.eos_id"),
    (_tiny, "rollout.eos_id", -2, "rollout.eos_id"),  # -1 alone means no stop token
    (_tiny, "rollout.max_episodes_per_slice", 4, "rollout.max_episodes_per_slice"),  # < 8
    (_tiny, "rollout.max_episodes_per_slice", 16, "rollout.max_episodes_per_slice"),  # no env
    (_tiny, "rollout.episode_kv", "disk", "rollout.episode_kv"),
    (_tiny, "data.env_latency_median", -1.0, "data.env_latency_median"),
    (_multiturn_tiny, "data.env_latency_median", 20.0, "data.env_latency_max"),  # 200 s > 30
    (_tiny, "trainer.loss_agg_mode", "mean", "trainer.loss_agg_mode"),
    (_tiny, "trainer.advantage", "ppo", "trainer.advantage"),
    (_tiny, "trainer.dual_clip", 0.5, "trainer.dual_clip"),
    (_tiny, "trainer.micro_batches", 0, "trainer.micro_batches"),
    (_tiny, "trainer.length_buckets", (16,), "trainer.length_buckets"),  # < 16+16
    (_tiny, "coordinator.mode", "async", "coordinator.mode"),
    (_tiny, "coordinator.rollout_batch_size", 3, "coordinator.rollout_batch_size"),  # < TBS
    (_tiny, "coordinator.max_staleness", -1, "coordinator.max_staleness"),
    (_tiny, "coordinator.group_size", 33, "coordinator.group_size"),  # > 4 slices x 8 slots
    (_tiny, "coordinator.num_steps", 0, "coordinator.num_steps"),
    (_tiny, "trainer.micro_batches", 3, "coordinator.train_batch_size"),  # 16 samples / 3
    (_tiny, "data.source", "hub", "data.source"),
    (_tiny, "data.source", "tfds", "data.tfds_name"),
    (_tiny, "data.source", "gsm8k", "data.path"),
    (_tiny, "data.source", "reasoning_gym", "data.task"),
    (_tiny, "coordinator.reward_max_response", 15, "coordinator.reward_max_response"),
    (_tiny, "coordinator.reward_workers", 0, "coordinator.reward_workers"),
    (_tiny, "data.reward", "gsm8k", "data.tokenizer"),  # decoded text needs a tokenizer
    (_tiny, "data.reward", "bleu", "data.reward"),
    (_tiny, "model.checkpoint", "/nonexistent/ckpt", "model.checkpoint"),
    (_tiny, "data.tokenizer", "/nonexistent/tok", "data.tokenizer"),
    (_tiny, "data.prompt_len", 17, "data.prompt_len"),  # > max_prefill_length 16
    (_tiny, "data.modulus", 1, "data.modulus"),
    (_tiny, "data.count_sigma", -0.5, "data.count_sigma"),
]


@pytest.mark.parametrize("base,field,value,named", INVALID,
                         ids=[f"{f}={v}" for _, f, v, _ in INVALID])
def test_invalid_value_names_field(base, field, value, named, load_config):
    c = _set(load_config(base, validate=False), field, value)
    with pytest.raises(config_lib.ConfigError, match=re.escape(f"config.{named}")):
        hf_checks.validated(c)  # device count is its own rule, below


def test_mesh_larger_than_devices(load_config):
    c = load_config(_spread, validate=False)
    c.mesh.num_slices = 5  # 4 trainer + 5 slices = 9 > 8
    with pytest.raises(config_lib.ConfigError, match=r"config\.mesh: .*9.*only 8 devices"):
        hf_checks.validated(c, num_devices=8)
    hf_checks.validated(c)  # without a device count the shape alone is fine


def test_mesh_missing_axis_and_bad_rule(load_config):
    c = load_config(_tiny, validate=False)
    del c.mesh.trainer["expert"]
    with pytest.raises(config_lib.ConfigError, match=r"config\.mesh\.trainer"):
        hf_checks.validated(c)
    c = load_config(_tiny, validate=False)
    c.mesh.decode_rules = (("embed", "fsdp"),)  # slices have no fsdp axis
    with pytest.raises(config_lib.ConfigError, match=r"config\.mesh\.decode_rules"):
        hf_checks.validated(c)


def test_unknown_fields_are_rejected(load_config):
    c = load_config(_tiny, validate=False)
    c.model.num_head = 4  # typo
    with pytest.raises(config_lib.ConfigError, match=r"num_head"):
        hf_checks.validated(c)
    c = load_config(_tiny, validate=False)
    c.trainer.lr = 0.1
    with pytest.raises(config_lib.ConfigError, match=r"config\.trainer.*lr"):
        hf_checks.validated(c)


def test_shipped_configs_load_by_name_from_any_directory(tmp_path, monkeypatch):
    """configs/ is the package's dora_jax/configs: a name loads the same config as the
    path, from a directory that is not the clone."""
    from dora_jax import configs

    assert configs.names() == sorted(p.split("/")[1][:-3] for p in CONFIG_FILES)
    assert (REPO / "configs").resolve() == (REPO / "dora_jax" / "configs").resolve()
    by_path = config_lib.load(str(REPO / "configs/moe.py") + ":tiny")
    monkeypatch.chdir(tmp_path)
    assert config_lib.load("moe:tiny").to_dict() == by_path.to_dict()
    assert configs.unknown("tiny") is None and "no such shipped config" in configs.unknown("tin")
    (tmp_path / "tiny").mkdir()  # a directory named like a config is no config file
    assert configs.resolve("tiny") == "tiny"


def test_the_flagship_without_a_checkpoint_needs_no_file(load_config):
    """configs/moe.py as written: a procedural token task, no tokenizer, no data file;
    with a tokenizer (a checkpoint's, here the shipped one) its EOS and pad ids are the
    tokenizer's, and the token task is refused, naming a text source."""
    from dora_jax.data import word_problems

    cfg = load_config("configs/moe.py")
    assert (cfg.data.source, cfg.data.tokenizer, cfg.data.path) == ("countdown", "", "")
    assert cfg.mesh.total_devices == 256
    with pytest.raises(config_lib.ConfigError, match=r"config\.data\.source: 'countdown' is a "
                                                     r"token task .*data\.source=gsm8k"):
        load_config("configs/moe.py", data__tokenizer=word_problems.TOKENIZER_DIR)
    cfg = load_config("configs/moe.py", data__tokenizer=word_problems.TOKENIZER_DIR,
                      data__source="gsm8k", data__reward="gsm8k",
                      data__path=word_problems.PROBLEMS_FILE)
    tok = word_problems.TOKENIZER_DIR
    from dora_jax.text.tokenizer import Tokenizer

    t = Tokenizer.from_pretrained(tok)
    assert (cfg.rollout.eos_id, cfg.rollout.pad_id) == (t.eos_id, t.pad_id)


def test_unknown_variant(load_config):
    with pytest.raises(ValueError, match="variant"):
        load_config("configs/moe.py:huge")


def test_decode_rules_are_the_trainer_rules_without_data_and_fsdp():
    # Written out by hand: what a decode slice (tensor x expert, full params) shards.
    assert dict(config_lib.DECODE_RULES) == {
        "batch": None, "length": None, "embed": None, "vocab": "tensor", "heads": "tensor",
        "kv_heads": "tensor", "head_dim": None, "mlp": "tensor", "expert": "expert",
        "expert_mlp": "tensor", "cache_length": None, "layers": None, "lora_rank": None}


def test_base_is_the_schema():
    c = config_lib.base()
    # Required fields are typed placeholders: unset, they are named when validating.
    assert c.model.vocab_size is None
    # No architecture and no checkpoint to take it from: the way to set it is named.
    with pytest.raises(config_lib.ConfigError, match=r"config\.model\.checkpoint: this config"):
        hf_checks.validated(c)
    c.model.vocab_size = 128
    with pytest.raises(config_lib.ConfigError, match=r"config\.model\.d_model: must be set"):
        hf_checks.validated(c)
    c.model.vocab_size = None
    # None-default fields accept a typed value (a command-line override parses).
    c.trainer.dual_clip = 3.0
    with pytest.raises(TypeError):
        c.trainer.dual_clip = "three"
    # Every dataclass field has its place, and no other.
    sections = {"model": config_lib.ModelConfig, "rollout": config_lib.RolloutConfig,
                "trainer": config_lib.TrainerConfig, "coordinator": config_lib.CoordinatorConfig,
                "data": config_lib.DataConfig, "mesh": config_lib.MeshConfig}
    for name, cls in sections.items():
        assert set(c[name]) == {f.name for f in dataclasses.fields(cls)}, name


def test_countdown_must_fit_the_decode_limit_and_vocab(load_config):
    c = load_config(_tiny, validate=False)
    c.data.source = "countdown"
    c.data.max_count = 16  # a countdown of 16 is 17 tokens > max_decode_len 16
    with pytest.raises(config_lib.ConfigError, match=r"config\.data\.max_count"):
        hf_checks.validated(c)
    c.data.max_count = 15
    hf_checks.validated(c)
    c.rollout.max_decode_len, c.trainer.length_buckets = 256, (272,)
    c.data.max_count = 200  # numbers up to 199 need more than vocab 128 - 3
    with pytest.raises(config_lib.ConfigError, match=r"config\.data\.max_count"):
        hf_checks.validated(c)


def test_colocate_spreads_trainer_and_slices_over_the_same_devices(load_config):
    """colocate() of a disaggregated layout: the same 8 devices, the trainer's data
    axis grown to span them all, slices of the same shape covering them too; sync
    runs on it, the modes that overlap rollout and training refuse it."""
    c = load_config(_spread, validate=False)
    c.coordinator.mode = "sync"
    c.mesh.update(config_lib.colocate(c.mesh.to_dict()))
    cfg = hf_checks.validated(c, num_devices=8)
    assert cfg.mesh.colocated and cfg.mesh.total_devices == 8
    assert cfg.mesh.trainer == {"data": 4, "fsdp": 2, "tensor": 1, "expert": 1}
    assert cfg.mesh.num_slices == 8 and cfg.mesh.slice_devices == 1
    c.coordinator.mode = "dora"
    with pytest.raises(config_lib.ConfigError, match=r"config\.mesh\.colocated: .* \(sync\)"):
        hf_checks.validated(c)


def test_colocated_sync_is_no_longer_a_mode(load_config):
    c = load_config("configs/tiny.py", validate=False)
    c.coordinator.mode = "colocated_sync"
    with pytest.raises(config_lib.ConfigError, match=r"config\.coordinator\.mode: "
                       r"'colocated_sync' is no longer a mode; .* coordinator\.mode=sync "
                       r"with mesh\.colocated=True"):
        hf_checks.validated(c)


@pytest.mark.parametrize("change, named", [
    (dict(num_slices=3), r"mesh\.trainer: colocation .* must divide 7"),  # 4 + 3 devices
    (dict(colocated=True, num_slices=3), r"mesh\.num_slices: colocated: 3 slices x 1 devices"),
])
def test_colocated_layout_errors_name_the_field(change, named, load_config):
    c = load_config(_spread, validate=False)
    c.coordinator.mode = "sync"
    c.mesh.update(change)
    with pytest.raises(config_lib.ConfigError, match=named):
        c.mesh.update(config_lib.colocate(c.mesh.to_dict()))
        hf_checks.validated(c)


def test_batch_must_divide_over_the_trainer_batch_shards(load_config):
    c = load_config(_spread, validate=False)
    c.coordinator.train_batch_size = 3  # 12 samples over data 2 x fsdp 2 = 4: fine
    hf_checks.validated(c)
    c.coordinator.group_size = 3  # 9 samples: not
    with pytest.raises(config_lib.ConfigError,
                       match=r"coordinator\.train_batch_size: .* 4 batch shards"):
        hf_checks.validated(c)


def test_host_fakes_cpu_devices_only_when_it_should(monkeypatch):
    from dora_jax.config import devices as host

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_something=1")
    note = host.fake_cpu_devices_if_needed(12)
    assert "running on 12 CPU devices" in note
    assert os.environ["XLA_FLAGS"] == ("--xla_cpu_something=1 "
                                       "--xla_force_host_platform_device_count=12")
    assert host.fake_cpu_devices_if_needed(4) is None  # already says how many
    monkeypatch.delenv("XLA_FLAGS")
    # A pod's mesh is not faked: the device check names the config's CPU variant.
    assert host.fake_cpu_devices_if_needed(256) is None and "XLA_FLAGS" not in os.environ
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")  # an accelerator: nothing to fake
    assert host.fake_cpu_devices_if_needed(8) is None and "XLA_FLAGS" not in os.environ
    with pytest.raises(RuntimeError, match="slice processes.*--trainer_processes.*Pathways"):
        host.require_single_controller(4)
    host.require_single_controller(1)


def test_validate_is_pure(load_config, monkeypatch):
    """validate reads no file: a checkpoint or tokenizer it names is read beforehand
    (model/hf_checks.py), and without what they determine it refuses, naming the field."""
    import builtins

    c = load_config("configs/tiny.py", validate=False)

    def no_files(*a, **kw):
        raise AssertionError("validate opened a file")

    monkeypatch.setattr(builtins, "open", no_files)
    config_lib.validate(c)
    c.data.tokenizer = "/some/tokenizer"
    with pytest.raises(config_lib.ConfigError, match=r"config\.data\.tokenizer: names files"):
        config_lib.validate(c)
