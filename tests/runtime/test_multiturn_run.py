"""Multi-turn episodes through the whole run: the ledger's turns, C1 per episode,
partial rollout's mixed versions, resume with finished episodes kept."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import pytest
from conftest import audit_workdir, load_repo_config

from dora_jax.base.turns import check_turns
from dora_jax.data import word_problems
from dora_jax.envs import base
from dora_jax.runtime import experiment

MAX_TURNS = 3


@base.register("test_always_continue")
class AlwaysContinue(base.Environment):
    """Answers every turn with "ok" and a quarter point; never ends an episode, so
    episodes end at their turn limit or token budget."""

    max_turns = MAX_TURNS

    def reset(self, record):
        return f"Say anything ({record['prompt_id']})."

    def step(self, action):
        return base.StepResult("ok", 0.25, False, {"tool_calls": 1})

    @classmethod
    def records(cls, num, seed):
        return [{"prompt_id": f"t{seed}-{i}"} for i in range(num)]


@pytest.fixture(scope="module")
def chatty_tokenizer(tmp_path_factory):
    """The shipped tokenizer with a hundred more stop ids (a generation config's
    eos_token_id list), so a random policy ends its turns after a few tokens."""
    path = tmp_path_factory.mktemp("tok")
    for name in os.listdir(word_problems.TOKENIZER_DIR):
        shutil.copy(os.path.join(word_problems.TOKENIZER_DIR, name), path)
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [3] + list(range(200, 300))}))
    return str(path)


def config(tokenizer, mode, steps, **over):
    return load_repo_config(
        "configs/multiturn.py:tiny", num_devices=8, data__env="test_always_continue",
        data__tokenizer=tokenizer, data__num_prompts=64, coordinator__mode=mode,
        coordinator__num_steps=steps, coordinator__checkpoint_every=1,
        model__num_layers=1, model__d_model=64, model__num_heads=2, model__num_kv_heads=1,
        model__head_dim=32, model__mlp_hidden=128, **over)


def episode_samples(events):
    return [(e, s) for e in events if e["event"] == "consume" for s in e["samples"]]


def _first_observation_waits_for_version_1(monkeypatch, num_slices: int) -> None:
    """The first environment call of the run waits until every slice holds version 1:
    its episode's next turn then decodes under the version published meanwhile, so
    that a publish lands within an episode by construction, not by the machine's pace
    (the other groups of version 0 train step 0 meanwhile)."""
    from dora_jax.rollout.slice_versions import ResidentVersions

    loaded, changed, first = {}, threading.Condition(), []
    load, step = ResidentVersions._load, AlwaysContinue.step

    def recording_load(self, version, params):  # every load: plain, or interrupting
        seconds = load(self, version, params)
        with changed:
            loaded[self.slice_id] = version
            changed.notify_all()
        return seconds

    def waiting_step(self, action):
        with changed:
            if not first:
                first.append(action)
                if not changed.wait_for(lambda: len(loaded) == num_slices
                                        and min(loaded.values()) >= 1, timeout=200):
                    raise TimeoutError("version 1 never reached every slice")
        return step(self, action)

    monkeypatch.setattr(ResidentVersions, "_load", recording_load)
    monkeypatch.setattr(AlwaysContinue, "step", waiting_step)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dora", "partial_rollout"])
def test_episodes_run_audited_with_their_turns_in_the_ledger(mode, chatty_tokenizer,
                                                               tmp_path, monkeypatch):
    # An environment call may wait for version 1 (partial_rollout, below): well within
    # the call's time limit, which would end the episode.
    over = dict(data__env_timeout=300.0) if mode == "partial_rollout" else {}
    # Three steps first: the episode held at its environment (below) finishes, under two
    # versions, while version 0's groups are still trained, before the run stops.
    cfg = config(chatty_tokenizer, mode, steps=3, **over)
    before = {t for t in threading.enumerate() if t.name.startswith("env ")}
    if mode == "partial_rollout":
        _first_observation_waits_for_version_1(monkeypatch, cfg.mesh.num_slices)
    experiment.run(cfg, str(tmp_path))
    monkeypatch.undo()
    cfg = config(chatty_tokenizer, mode, steps=5, **over)  # the same run, resumed and continued
    summary = experiment.run(cfg, str(tmp_path))
    # A finished run leaves no environment thread behind (an event loop per slice).
    def env_threads():
        return {t for t in threading.enumerate() if t.name.startswith("env ")} - before
    deadline = time.monotonic() + 10
    while env_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not env_threads()
    events, audit = audit_workdir(cfg, str(tmp_path))
    assert audit.ok, audit.summary()
    assert any(e["event"] == "resume" for e in events)
    samples = episode_samples(events)
    assert samples
    several = 0
    for consume, s in samples:
        assert check_turns(s, s["response_len"]) is None
        model_turns = sum(1 for t in s["turns"] if t[0] == "model")
        env_turns = [t for t in s["turns"] if t[0] == "env"]
        several += model_turns > 1
        assert 1 <= model_turns <= MAX_TURNS
        # A quarter for every turn that reached the environment: all but a last turn
        # cut at the token budget.
        assert s["reward"] == pytest.approx(0.25 * (len(env_turns) + (s["finish"] == "eos")))
        assert s["episode_end"] in ("max_turns", "budget")
        assert all(t[3] >= 0 for t in env_turns) and s.get("env_s", 0) >= 0
        if mode == "dora":  # C1 for the whole episode
            assert {v for v, _ in s["versions"]} == {consume["version"]}
    assert several >= len(samples) // 2
    metrics = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert all(m["episodes"]["episodes"] == 8 for m in metrics if "step" in m)
    assert summary["episodes_last"]["tool_use"] == 1.0
    if mode == "partial_rollout":  # reloads land between (and within) turns
        mixed = [s for _, s in samples if len({v for v, _ in s["versions"]}) > 1]
        assert mixed, "partial rollout should mix versions within some episodes"
        assert any(v == 0 for s in mixed for v, _ in s["versions"]), mixed


@pytest.mark.slow
def test_episodes_migrate_between_slices_and_stay_on_their_version(chatty_tokenizer,
                                                                   tmp_path, monkeypatch):
    """DORA with a migration forced wherever legal (test_runtime's
    `_forced_migrations`): episodes leave their slice mid-episode, at their
    environment or decoding, and finish on another under their group's version."""
    from test_runtime import _forced_migrations

    forced = _forced_migrations(monkeypatch)
    cfg = config(chatty_tokenizer, "dora", steps=3)
    summary = experiment.run(cfg, str(tmp_path))
    events, audit = audit_workdir(cfg, str(tmp_path))
    assert audit.ok, audit.summary()
    assert forced and summary["migrations"] >= 1
    moved = [s for _, s in episode_samples(events) if len(s["slices"]) > 1]
    assert moved, "some consumed episode should have moved"
    for s in moved:
        assert check_turns(s, s["response_len"]) is None
    assert any(sum(1 for t in s["turns"] if t[0] == "model") > 1 for s in moved)


@pytest.mark.slow
def test_a_kill_while_episodes_wait_on_slow_tools_resumes_whole(chatty_tokenizer, tmp_path):
    """SIGKILL while episodes wait for a slow calculator (0.3 s a call), their slots
    given to others (16 episodes per slice of 8 slots); the same command resumes:
    nothing lost or trained twice, the ledger audited clean, C1 per episode."""
    import subprocess
    import sys

    from conftest import REPO, assert_resumed_whole

    workdir = tmp_path / "run"
    over = dict(data__tokenizer=chatty_tokenizer, data__env_latency_median=0.3,
                data__env_latency_max=1.0, rollout__max_episodes_per_slice=16,
                coordinator__num_steps=4, coordinator__checkpoint_every=1,
                model__num_layers=1, model__d_model=64, model__num_heads=2,
                model__num_kv_heads=1, model__head_dim=32, model__mlp_hidden=128)
    flags = [f"--config.{k.replace('__', '.')}={v}" for k, v in over.items()]
    cmd = [sys.executable, "-m", "dora_jax.main", "--config=configs/multiturn.py:tiny",
           f"--workdir={workdir}", *flags]
    killed = subprocess.run(cmd + ["--config.coordinator.kill_point=at_environment",
                                   "--config.coordinator.kill_after=2"],
                            cwd=REPO, capture_output=True, text=True, timeout=900)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert "killing the run at at_environment" in killed.stderr
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    cfg = load_repo_config("configs/multiturn.py:tiny", num_devices=8, **over)
    standing = assert_resumed_whole(cfg, workdir)
    samples = episode_samples(standing)
    # Random text ends a calculator episode at its first call, which still waits.
    assert sum(s.get("env_s", 0) >= 0.1 for _, s in samples) >= len(samples) // 2
    for consume, s in samples:
        assert check_turns(s, s["response_len"]) is None
        assert {v for v, _ in s["versions"]} == {consume["version"]}
