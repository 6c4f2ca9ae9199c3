"""Resume checked by content, end to end on 8 fake devices: the finished groups a
checkpoint keeps come back with the very trajectories and rewards they had before the
crash, and the prompt stream neither repeats nor skips a prompt across resumes.

No test here depends on timing: where a run must be in a given state at a
checkpoint (finished groups waiting for the trainer), the trainer waits inside its
step until the coordinator reports that state."""

import os
import threading

import pytest
from conftest import audit_workdir

from dora_jax.data import prompts as prompts_lib
from dora_jax.rl.trainer import Trainer
from dora_jax.runtime import experiment, loop
from dora_jax.runtime.loop import RunError
from dora_jax.scheduler import ledger
from dora_jax.tasks.sources import prompt_records

DRAIN_WAIT = 300  # seconds: a bound on a hang, not a pace the test relies on


class _Observed(loop.Runtime):
    """A Runtime that keeps what it hands the trainer (each group's trajectories, by
    group id) and sets `drained` once, with a train step running, no sample is left
    in flight and at least one finished group waits for the next batch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.handed: dict = {}
        self.drained = threading.Event()

    def train(self, a):
        super().train(a)
        for gid in a.group_ids:
            self.handed[gid] = [t.to_dict() for t in self.book[gid].samples()]

    def _handle(self, ev):
        steps = super()._handle(ev)
        self._check_drained()
        return steps

    def _decide(self):
        super()._decide()
        self._check_drained()

    def _check_drained(self):
        s = self.sched
        if s.trainer_busy and s.num_unfinished_samples == 0 and s.num_finished_groups:
            self.drained.set()


class _Runs:
    """Builds the runs' trainers and runtimes. The trainer waits in step `wait_at`
    until the runtime is `drained` and raises in step `fail_at` (None: never)."""

    def __init__(self, monkeypatch):
        self.runtimes = []
        runtimes = self.runtimes

        class Recorded(_Observed):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                runtimes.append(self)

        monkeypatch.setattr(experiment, "Runtime", Recorded)

    def run(self, cfg, workdir, *, wait_at=None, fail_at=None):
        runtimes = self.runtimes

        class Instrumented(Trainer):
            def train_step(self, batch):
                if self.version == wait_at and not runtimes[-1].drained.wait(DRAIN_WAIT):
                    raise TimeoutError(f"step {wait_at}: the rollout never drained")
                if self.version == fail_at:
                    raise FloatingPointError(f"injected failure in step {self.version}")
                return super().train_step(batch)

        return experiment.run(cfg, str(workdir), make_trainer=Instrumented)


def _checkpoint_extra(workdir, step) -> dict:
    """What checkpoint `step` holds besides the train state, read back from disk."""
    from dora_jax.model.checkpointing import Checkpointer

    with Checkpointer(os.path.join(workdir, "checkpoints")) as ckpt:
        return ckpt.read_extra(step)


def _content(trajectories: list) -> list:
    """Trajectories as dicts without the shaped reward the batch sets on them."""
    return [{k: v for k, v in t.items() if k != "reward"} for t in trajectories]


def test_kept_groups_come_back_with_their_trajectories_and_rewards(tmp_path, small_config,
                                                                   monkeypatch):
    """K = 1, TBS 2: step 0 trains two of the four version-0 groups while the other
    two finish (the trainer waits for that), so the checkpoint of version 1 keeps two
    finished, unconsumed groups; step 1 then fails. The resumed run keeps them
    (`resume` line: kept = 2, nothing regenerated for them) and trains exactly the
    trajectories (tokens, log-probs, versions, slices) and rewards saved before the
    failure, which are those the failed run had handed its trainer."""
    cfg = small_config("dora", train_batch_size=2, rollout_batch_size=8, max_staleness=1,
                       num_steps=3, checkpoint_every=1)
    runs = _Runs(monkeypatch)
    with pytest.raises(RunError, match="injected failure in step 1"):
        runs.run(cfg, tmp_path, wait_at=0, fail_at=1)
    failed = runs.runtimes[-1]
    saved = {int(g): d for g, d in _checkpoint_extra(tmp_path, 1)["finished_groups"].items()}
    assert saved, "the checkpoint of version 1 keeps no finished group"
    # Rewards that a zeroed restore would change (the residue reward of version 0's
    # samples, the same in every run: one seed, one set of params).
    assert any(r != 0.0 for d in saved.values() for r, _ in d["rewards"]), saved
    for gid, d in saved.items():  # the checkpoint holds what the failed run trained
        assert d["version"] == 0 and len(d["samples"]) == cfg.coordinator.group_size
        assert _content(failed.handed[gid]) == _content(d["samples"]), gid

    summary = runs.run(cfg, tmp_path)
    resumed = runs.runtimes[-1]
    assert summary["resumed_from_step"] == 1
    events, report = audit_workdir(cfg, tmp_path)
    assert report.ok and report.steps == 3, report.summary() + str(report.c2[:3])
    [resume] = [e for e in events if e["event"] == "resume"]
    after = events[events.index(resume):]
    assert resume["kept"] == len(saved) > 0, resume
    # A kept group is not admitted again: it is trained as it was.
    assert not {e["group_id"] for e in after if e["event"] == "admit"} & set(saved)
    consumed = {e["group_id"]: e for e in after if e["event"] == "consume"}
    for gid, d in saved.items():
        line = consumed[gid]
        assert (line["version"], line["step"]) == (0, 1), line  # its deadline: step 1
        for entry, t, (reward, error) in zip(line["samples"], d["samples"], d["rewards"]):
            assert entry["sample"] == t["sample_index"]
            assert entry["reward"] == reward and entry.get("reward_error") == error, gid
            assert entry["response_len"] == len(t["response_tokens"])
            assert (entry["versions"], entry["slices"], entry["finish"]) == (
                t["versions"], t["slice_ids"], t["finish_reason"]), gid
        assert _content(resumed.handed[gid]) == _content(d["samples"]), gid


def _first_admissions(events) -> dict:
    """group id -> prompt id of each group's first admission; every readmission is of
    the same prompt, and no group is admitted afresh twice."""
    first = {}
    for e in events:
        if e["event"] != "admit":
            continue
        if e.get("readmit"):
            assert first[e["group_id"]] == e["prompt_id"], e
        else:
            assert e["group_id"] not in first, f"group {e['group_id']} admitted afresh twice"
            first[e["group_id"]] = e["prompt_id"]
    return first


def test_the_prompt_stream_neither_repeats_nor_skips_across_resumes(tmp_path, small_config,
                                                                    monkeypatch):
    """A run failing at step 2, resumed, failing again at step 4, resumed again to
    step 5, admits group n with the same prompt as an uninterrupted run of the same
    seed and config: the n-th prompt of the stream. Each resume restarts the stream
    from its checkpoint past the prompts given out after it (the test checks that
    there were some)."""
    cfg = small_config("dora", num_steps=5, checkpoint_every=1)
    runs = _Runs(monkeypatch)
    whole = _first_admissions(ledger.read(str(_uninterrupted(runs, cfg, tmp_path))))

    workdir = tmp_path / "resumed"
    given_out = []  # groups admitted after the checkpoint a resume starts from
    for fail_at in (2, 4, None):
        if fail_at is None:
            runs.run(cfg, workdir)
        else:
            with pytest.raises(RunError, match=f"injected failure in step {fail_at}"):
                runs.run(cfg, workdir, fail_at=fail_at)
            checkpoint = _checkpoint_extra(workdir, fail_at)["scheduler"]["next_group_id"]
            admitted = ledger.read(str(workdir / "ledger.jsonl"))
            given_out.append(max(_first_admissions(admitted)) + 1 - checkpoint)
    events, report = audit_workdir(cfg, workdir)
    assert report.ok and report.steps == 5, report.summary() + str(report.c2[:3])
    assert sum(e["event"] == "resume" for e in events) == 2
    assert any(n > 0 for n in given_out), given_out

    records = prompt_records(cfg)[0]
    stream = prompts_lib.PromptStream(prompts_lib.prompt_dataset(
        records, seed=cfg.seed, shuffle=cfg.data.shuffle, num_epochs=cfg.data.num_epochs))
    first = _first_admissions(events)
    n = max(max(first), max(whole)) + 1
    in_order = {gid: stream.next()["prompt_id"] for gid in range(n)}
    assert whole == {g: in_order[g] for g in range(len(whole))}
    assert first == {g: in_order[g] for g in range(len(first))}
    assert len(set(first.values())) == len(first)  # no prompt given twice


def _uninterrupted(runs, cfg, tmp_path):
    workdir = tmp_path / "whole"
    runs.run(cfg, workdir)
    return workdir / "ledger.jsonl"
