"""A run from a Hugging Face checkpoint and tokenizer: the config takes what the
checkpoint determines (and refuses what contradicts it), the shipped CPU assets
rebuild identically, and a GSM8K-format run from a checkpoint trains, audits clean
and exports a checkpoint that loads back (in transformers too, where installed)."""

import json
import os

import jax
import numpy as np
import pytest
from conftest import audit_workdir, reference

from dora_jax import config as config_lib
from dora_jax.data import word_problems
from dora_jax.model import hf, hf_checks
from dora_jax.tasks import sources
from dora_jax.text.tokenizer import Tokenizer

HF_FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf")
QWEN3_FIXTURE = os.path.join(HF_FIXTURES, "qwen3")


def test_checkpoint_sets_the_architecture(load_config):
    c = load_config("configs/qwen3_gsm8k.py", validate=False)
    c.model.checkpoint = QWEN3_FIXTURE
    c.data.tokenizer = word_problems.TOKENIZER_DIR
    with pytest.raises(config_lib.ConfigError, match=r"data.tokenizer: 512 tokens do not fit "
                                                     r"model.vocab_size \(61\)"):
        hf_checks.validated(c)
    c.data.source, c.data.reward, c.data.tokenizer = "residue", "residue", ""
    c.data.update(dict(prompt_len=4, modulus=4))
    cfg = hf_checks.validated(c)
    m = cfg.model
    assert (m.vocab_size, m.d_model, m.num_layers, m.head_dim, m.rope_theta) == (
        61, 48, 3, 20, 1_000_000.0)
    assert m.qk_norm and not m.tie_embeddings and m.dtype == "bfloat16"  # how: the config's


def test_a_field_set_against_the_checkpoint_is_named(load_config):
    c = load_config("configs/tiny.py:spread", validate=False)
    c.model.checkpoint = QWEN3_FIXTURE  # configs/tiny.py sets vocab 128, d_model 64 ...
    with pytest.raises(config_lib.ConfigError,
                       match=r"config.model.vocab_size: 128, but checkpoint .* has 61"):
        hf_checks.validated(c)


def test_tokenizer_sets_eos_and_pad_and_refuses_others(load_config, tiny_hf_checkpoint):
    c = load_config("configs/qwen3_gsm8k.py", validate=False)
    c.model.checkpoint, c.data.path = tiny_hf_checkpoint, word_problems.PROBLEMS_FILE
    cfg = hf_checks.validated(c)
    tok = Tokenizer.from_pretrained(tiny_hf_checkpoint)
    assert cfg.data.tokenizer == tiny_hf_checkpoint
    assert (cfg.rollout.eos_id, cfg.rollout.pad_id) == (tok.eos_id, tok.pad_id) == (3, 0)
    c.rollout.eos_id = 7
    with pytest.raises(config_lib.ConfigError, match=r"config.rollout.eos_id: 7, but tokenizer"):
        hf_checks.validated(c)


def test_shipped_assets_rebuild_identically(tmp_path):
    with open(word_problems.PROBLEMS_FILE) as f:
        shipped = [json.loads(line) for line in f]
    assert shipped == word_problems.word_problems(200, seed=0)
    for p in shipped[:50]:  # each answer's worked solution computes its final number
        steps, final = p["answer"].rsplit("\n#### ", 1)
        last = steps.split("=")[-1].split()[0].rstrip(".,")
        assert last == final, p
    from dora_jax.text.tokenizer import train_tokenizer

    train_tokenizer(word_problems.tokenizer_corpus(),
                    word_problems.TOKENIZER_VOCAB).save_pretrained(str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(word_problems.TOKENIZER_DIR, name)) as a, \
                open(tmp_path / name) as b:
            assert json.load(a) == json.load(b), name


def test_text_prompts_and_verifier_of_the_gsm8k_config(load_config):
    cfg = load_config("configs/qwen3_gsm8k.py:tiny")
    tok = sources.tokenizer_for(cfg)
    records, skipped = sources.prompt_records(cfg, tok)
    assert len(records) == 200 and not skipped
    text = tok.decode(records[0]["tokens"], skip_special_tokens=False)
    assert text.startswith("<|im_start|>user\n" + records[0]["question"])
    assert text.endswith("<|im_start|>assistant\n")
    reward = sources.reward_for(cfg, tok)
    demo = sources.demonstration_for(cfg, tok)(records[0])
    assert reward(records[0], demo) == 1.0
    wrong = tok.encode(f"#### {int(records[0]['answer']) + 1}") + [tok.eos_id]
    assert reward(records[0], wrong) == 0.0


@pytest.mark.slow
def test_a_run_from_a_checkpoint_trains_audits_and_exports(load_config, tiny_hf_checkpoint,
                                                         tmp_path):
    from dora_jax import export
    from dora_jax.runtime import experiment

    c = load_config("configs/qwen3_gsm8k.py:tiny", validate=False)
    c.model.checkpoint = tiny_hf_checkpoint
    c.data.tokenizer = ""  # from the checkpoint
    c.coordinator.num_steps = 3
    cfg = hf_checks.validated(c, num_devices=8)
    workdir = str(tmp_path / "run")
    from dora_jax.rl.trainer import Trainer

    made = []
    summary = experiment.run(cfg, workdir,
                             make_trainer=lambda *a, **k: made.append(Trainer(*a, **k)) or made[0])
    assert summary["steps"] == 3
    events, report = audit_workdir(cfg, workdir)
    assert report.ok, report
    samples = [s for e in events if e["event"] == "consume" for s in e["samples"]]
    assert samples and all("reward_error" not in s for s in samples)

    out = str(tmp_path / "hf")
    result = export.export(cfg, workdir, out)
    assert result["step"] == 3
    _, exported = hf.load_pretrained(out, cfg=cfg.model)
    for a, b in zip(jax.tree.leaves(exported), jax.tree.leaves(made[0].params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the run's last step
    assert Tokenizer.from_pretrained(out).encode("Ava has 3 apples") == \
        Tokenizer.from_pretrained(tiny_hf_checkpoint).encode("Ava has 3 apples")

    # The same from the command line, on a CPU host without XLA_FLAGS.
    import subprocess
    import sys

    from conftest import REPO, env_without_device_count

    env = env_without_device_count()
    cli_out = str(tmp_path / "hf_cli")
    done = subprocess.run(
        [sys.executable, "-m", "dora_jax.export", "--config=configs/qwen3_gsm8k.py:tiny",
         f"--config.model.checkpoint={tiny_hf_checkpoint}", "--config.data.tokenizer=",
         "--config.coordinator.num_steps=3", f"--workdir={workdir}", f"--out={cli_out}"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "wrote step 3" in done.stdout
    _, from_cli = hf.load_pretrained(cli_out, cfg=cfg.model)
    for a, b in zip(jax.tree.leaves(from_cli), jax.tree.leaves(exported)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    transformers = reference("transformers")
    torch = reference("torch")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokens = np.array([[5, 17, 33, 2, 90, 41]])
    from dora_jax.model import transformer

    graphdef, _ = transformer.abstract_params(cfg.model)
    ours, _, _ = transformer.apply(graphdef, exported, tokens)
    with torch.no_grad():
        theirs = model(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(theirs, np.asarray(ours), atol=1e-4, rtol=0)


def test_moe_config_loads_the_qwen3_30b_a3b_architecture(load_config, tmp_path):
    """configs/moe.py states Qwen3-30B-A3B's shapes; the hub checkpoint's config.json
    (older field names) agrees with every one, and a checkpoint of other shapes is
    refused by field. Only config files are read: no weights are needed to validate."""
    hub = os.path.join(HF_FIXTURES, "qwen3_30b_a3b")
    c = load_config("configs/moe.py", validate=False)
    c.model.checkpoint = hub
    cfg = hf_checks.validated(c)
    assert cfg.model.moe.num_experts == 128 and cfg.model.num_layers == 48
    other = json.load(open(os.path.join(hub, "config.json")))
    other["num_experts"] = 64
    (tmp_path / "config.json").write_text(json.dumps(other))
    c.model.checkpoint = str(tmp_path)
    with pytest.raises(config_lib.ConfigError,
                       match=r"config.model.moe.num_experts: 128, but checkpoint .* has 64"):
        hf_checks.validated(c)


def test_tfds_source_from_the_command_line_config(load_config, tmp_path):
    """data.source=tfds reads a dataset prepared by the local builder: the same
    prompts as the JSONL it was built from (nothing downloaded)."""
    from dora_jax.data import tfds_local

    name = tfds_local.prepare(word_problems.PROBLEMS_FILE, str(tmp_path), name="words")
    from_jsonl, _ = sources.prompt_records(load_config("configs/qwen3_gsm8k.py:tiny"))
    cfg = load_config("configs/qwen3_gsm8k.py:tiny", data__source="tfds", data__tfds_name=name,
                      data__tfds_dir=str(tmp_path), data__reward="by_record")
    from_tfds, _ = sources.prompt_records(cfg)
    key = lambda r: (r["prompt_id"], r["tokens"], r["answer"], r["verifier"])  # noqa: E731
    assert sorted(map(key, from_tfds)) == sorted(map(key, from_jsonl))
