"""The supervised warm start: teacher forcing learns the countdown's demonstrations,
and an RL run started from its checkpoint decodes with exactly those params."""

import dataclasses
import json
import os
import re

import jax
import numpy as np
import pytest
from _trainer_common import countdown_config
from conftest import audit_workdir

from dora_jax import sft
from dora_jax.model import hf_checks, layer_layout, transformer
from dora_jax.rewards.tokens import EOS, countdown_target
from dora_jax.rollout.slice import DecodeSlice
from dora_jax.runtime import experiment
from dora_jax.tasks import sources


def _greedy(graphdef, params, prompt, steps):
    tokens = list(prompt)
    for _ in range(steps):
        logits, _, _ = transformer.apply(graphdef, params, np.array([tokens]))
        tokens.append(int(np.argmax(logits[0, -1])))
        if tokens[-1] == EOS:
            break
    return tokens[len(prompt):]


def test_sft_learns_demonstrations_and_rl_starts_from_them(tmp_path, load_config,
                                                          monkeypatch, capsys):

    cfg = hf_checks.validated(countdown_config(load_config), num_devices=8)
    out = sft.train(cfg, str(tmp_path / "sft"), steps=150, batch_size=32, learning_rate=3e-3)
    assert out["loss_last"] < 0.1 * out["loss_first"], out
    log = [json.loads(line) for line in open(tmp_path / "sft" / "sft_metrics.jsonl")]
    assert log[-1]["step"] == 149
    # A progress line every tenth of the run, as it goes: step, loss, steps/s.
    progress = re.findall(r"^sft step (\d+)/150: loss (\d+\.\d{4}), (\d+\.\d\d) steps/s$",
                          capsys.readouterr().out, flags=re.M)
    assert [int(n) for n, _, _ in progress] == list(range(15, 151, 15)), progress
    assert all(float(rate) > 0 for _, _, rate in progress)
    assert float(progress[-1][1]) == pytest.approx(out["loss_last"], abs=1e-4)
    assert float(progress[-1][1]) < float(progress[0][1])

    graphdef, init = transformer.create(cfg.model, cfg.seed)
    from dora_jax.model.checkpointing import load_params

    params = load_params(out["checkpoint"], init)
    records = sources.prompt_records(cfg)[0][:8]
    exact = sum(_greedy(graphdef, params, r["tokens"], 16) == countdown_target(r)
                for r in records)
    assert exact >= 6, exact  # the random init gets none of them

    # RL from the checkpoint: every slice's version 0 is the SFT params.
    loaded = []
    load_version = DecodeSlice.load_version

    def recording(self, version, p):
        seconds = load_version(self, version, p)
        loaded.append((version, [np.asarray(x) for x in jax.device_get(self.params.leaves)]))
        return seconds

    monkeypatch.setattr(DecodeSlice, "load_version", recording)
    rl = hf_checks.validated(countdown_config(load_config), num_devices=8)
    rl = dataclasses.replace(rl, init_checkpoint=out["checkpoint"])
    summary = experiment.run(rl, str(tmp_path / "rl"))
    # as a slice lays params out: every layer apart
    want = [np.asarray(x) for x in jax.tree.leaves(layer_layout.unstack(rl.model, params))]
    first = [leaves for version, leaves in loaded if version == 0]
    assert len(first) == 4 and all(len(leaves) == len(want) and all(
        np.array_equal(a, b) for a, b in zip(leaves, want)) for leaves in first)
    _, report = audit_workdir(rl, str(tmp_path / "rl"))
    assert report.ok
    assert summary["reward_first"] > 0.5  # sampled at temperature 1 from the SFT policy


def test_missing_init_checkpoint_fails_before_compute(tmp_path, load_config):

    c = countdown_config(load_config)
    c.init_checkpoint = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.init_checkpoint"):
        experiment.run(hf_checks.validated(c, num_devices=8), str(tmp_path / "rl"))
    assert not os.path.exists(tmp_path / "rl" / "ledger.jsonl")


def test_progress_every_sets_the_lines_and_0_silences_them(tmp_path, load_config, capsys):
    """Before the first step a line says it compiles, after it how long that took, and
    the next run in the workdir says beforehand how long it will be."""
    cfg = hf_checks.validated(countdown_config(load_config), num_devices=8)
    for steps, said, shown in ((3, "first run: timing unknown", ["2/3", "3/3"]),
                               (4, "as the last run here took", ["2/4", "4/4"])):
        sft.train(cfg, str(tmp_path / "a"), steps=steps, batch_size=4, learning_rate=1e-3,
                  progress_every=2)
        out = capsys.readouterr().out.splitlines()
        assert out[0].startswith("compiling: train step (with the first update) (") and \
            said in out[0], out
        assert re.fullmatch(r"compiled in \d+ s: train step \(with the first update\) "
                            r"\d+\.\d s", out[1]), out
        assert [re.match(r"sft step (\d+/\d+):", line).group(1) for line in out[2:]] == shown
    sft.train(cfg, str(tmp_path / "b"), steps=3, batch_size=4, learning_rate=1e-3,
              progress_every=0)
    assert capsys.readouterr().out == ""


def test_task_without_demonstrations_is_refused(tmp_path, load_config):

    cfg = hf_checks.validated(load_config("configs/tiny.py:spread", validate=False), num_devices=8)
    with pytest.raises(ValueError, match="'residue' has no demonstrations"):
        sft.train(cfg, str(tmp_path), steps=1, batch_size=1, learning_rate=1e-3)
