"""Evaluation during training: pass_at_k by its definition, pass_at_1 of a fake verifier
computed by hand, the held-out split, and a run that evaluates every N steps on a
decode slice between its rollouts: the records in metrics.jsonl and TensorBoard
with the version each ran under, and the held-out prompts never admitted (the
ledger, audited)."""

import concurrent.futures
import json
import queue
import types

import pytest
from conftest import audit_workdir

from dora_jax.config.report import EvalConfig
from dora_jax.data import prompts
from dora_jax.model import hf_checks
from dora_jax.runtime import experiment
from dora_jax.runtime.evaluation import Evaluation, pass_at_k, summarise
from dora_jax.runtime.events import EvalGenerated, EvalScored
from dora_jax.tasks import sources


def test_pass_at_k_by_its_definition():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 3) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)  # 1 - C(2,2)/C(4,2)
    assert pass_at_k(4, 3, 2) == 1.0  # fewer wrong than k: some draw is right


class ExactPool:
    """A reward pool whose verifier scores 1 for a response equal to the record's
    answer, 0 otherwise; its futures are done at once."""

    def submit(self, record, response):
        f = concurrent.futures.Future()
        f.set_result((float(list(response) == record["answer"]), None))
        return f


def _traj(tokens):
    return types.SimpleNamespace(response_tokens=list(tokens))


def test_pass_at_1_of_a_fake_verifier_by_hand():
    cfg = EvalConfig(every=1, num_prompts=3, samples=3, k=2)
    records = [{"prompt_id": i, "tokens": [5], "answer": [7, i]} for i in range(3)]
    events = queue.Queue()
    e = Evaluation(cfg, records, types.SimpleNamespace(slice_id=0), ExactPool(), events,
                   clock=lambda: 1.0)
    # Greedy: right, wrong (and longer), right. Sampled: 1/3, 0/3 and 3/3 right.
    greedy = [_traj([7, 0]), _traj([7, 7, 7]), _traj([7, 2])]
    sampled = [[_traj([7, 0]), _traj([1]), _traj([2])],
               [_traj([1]), _traj([1]), _traj([1])],
               [_traj([7, 2])] * 3]
    e._pending[4] = None
    e.generated(EvalGenerated(0, 4, greedy, sampled, 0.25, 0.75))
    scored = events.get_nowait()
    assert scored == EvalScored(4)
    record = e.scored(scored)
    assert record["step"] == 4 and not e.pending
    ev = record["eval"]
    assert ev["version"] == 4 and ev["prompts"] == 3 and ev["k"] == 2
    assert ev["pass_at_1"] == pytest.approx(2 / 3)
    # pass@2 per prompt: 1 - C(2,2)/C(3,2) = 2/3, 0, 1.
    assert ev["pass_at_k"] == pytest.approx((2 / 3 + 0 + 1) / 3, abs=1e-6)
    assert ev["sampled_pass_at_1"] == pytest.approx((1 / 3 + 0 + 1) / 3, abs=1e-6)
    assert ev["response_length"] == pytest.approx((2 + 3 + 2) / 3, abs=1e-3)
    assert ev["sampled_response_length"] == pytest.approx((2 + 1 + 1 + 3 + 6) / 9, abs=1e-3)
    assert ev["seconds"] == 0.5 and ev["reward_errors"] == 0 and ev["slice"] == 0
    assert summarise(cfg, [(0.5, 1)], [[(1.0, 1)] * 3])["pass_at_1"] == 0.0  # below pass_reward


def test_held_out_split(load_config):
    c = load_config("configs/tiny.py:spread", validate=False)
    c.eval.every, c.eval.num_prompts = 5, 6
    cfg = hf_checks.validated(c, num_devices=8)
    records, _ = sources.prompt_records(cfg)
    train, held = sources.held_out_split(records, cfg)

    def ids(rs):
        return [r["prompt_id"] for r in rs]

    assert len(held) == 6 and len(train) == len(records) - 6
    assert not set(ids(train)) & set(ids(held))
    assert ids(train) == [i for i in ids(records) if i not in set(ids(held))]  # order kept
    assert sources.held_out_split(records, cfg) == (train, held)  # by the seed
    c.eval.every = 0
    assert sources.held_out_split(records, hf_checks.validated(c, num_devices=8)) == (records, [])
    c.eval.every, c.eval.num_prompts = 5, len(records)
    with pytest.raises(prompts.DataError, match="eval.num_prompts"):
        sources.held_out_split(records, hf_checks.validated(c, num_devices=8))


def test_eval_fields_are_validated(load_config):
    from dora_jax.config import ConfigError

    with pytest.raises(ConfigError, match=r"config.eval.k: must be <= eval.samples \(2\)"):
        load_config("configs/tiny.py:spread", num_devices=8, eval__samples=2, eval__k=3)
    with pytest.raises(ConfigError, match="config.eval.slice: must name a slice"):
        load_config("configs/tiny.py:spread", num_devices=8, eval__every=1, eval__slice=99)


def test_a_run_evaluates_every_n_steps_and_never_admits_held_out_prompts(tmp_path,
                                                                         small_config):
    c = small_config("dora", validate=False, num_steps=3)
    c.eval.update(dict(every=2, num_prompts=6, samples=3, k=2, slice=1))
    cfg = hf_checks.validated(c, num_devices=8)
    summary = experiment.run(cfg, str(tmp_path))
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    steps = [m for m in lines if "eval" not in m]
    evals = [m for m in lines if "eval" in m]
    assert [m["step"] for m in steps] == [0, 1, 2]
    # Before the first step, every 2 steps, and the final version.
    assert [m["step"] for m in evals] == [0, 2, 3]
    for m in evals:
        e = m["eval"]
        assert e["version"] == m["step"] and e["prompts"] == 6 and e["k"] == 2
        assert e["slice"] == 1 and e["reward_errors"] == 0
        for key in ("pass_at_1", "pass_at_k", "sampled_pass_at_1"):
            assert 0.0 <= e[key] <= 1.0
        assert e["pass_at_k"] >= e["sampled_pass_at_1"] - 1e-9
        assert 1 <= e["response_length"] <= cfg.rollout.max_decode_len
    assert summary["eval_first"]["version"] == 0 and summary["eval_last"]["version"] == 3
    from dora_jax.runtime.tensorboard import read_scalars

    board = read_scalars(str(tmp_path / "tensorboard"))
    assert [s for s, _ in board["eval/pass_at_1"]] == [0, 2, 3]
    assert [s for s, _ in board["reward_mean"]] == [0, 1, 2]
    # The held-out prompts never entered training; the ledger audits clean.
    records, _ = sources.prompt_records(cfg)
    _, held = sources.held_out_split(records, cfg)
    events, report = audit_workdir(cfg, tmp_path)
    admitted = {e["prompt_id"] for e in events if e["event"] == "admit"}
    assert admitted and not admitted & {r["prompt_id"] for r in held}
    assert report.ok, report.summary()
    # Each evaluation ran on slice 1, under the version it reports.
    spans = json.load(open(tmp_path / "timeline.json"))
    assert sorted({s["version"] for s in spans if s["kind"] == "eval"}) == [0, 2, 3]
    assert {s["row"] for s in spans if s["kind"] == "eval"} == {"slice 1"}


def test_an_evaluation_whose_slice_fails_is_dropped_and_the_run_goes_on(tmp_path,
                                                                       small_config,
                                                                       monkeypatch):
    from dora_jax.runtime.evaluation import EvalDecoder

    real, calls = EvalDecoder.generate, []

    def generate(self, version, params, records):
        calls.append(version)
        if version == 2:
            real(self, version, params, records[:1])  # a partial evaluation, then
            raise RuntimeError("injected failure during an evaluation")
        return real(self, version, params, records)

    monkeypatch.setattr(EvalDecoder, "generate", generate)
    c = small_config("dora", validate=False, num_steps=3)
    c.eval.update(dict(every=2, num_prompts=4, samples=2, k=2))
    cfg = hf_checks.validated(c, num_devices=8)
    summary = experiment.run(cfg, str(tmp_path))
    assert summary["slice_failures"] == 1 and calls == [0, 2, 3]
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [m["step"] for m in lines if "eval" in m] == [0, 3]
    assert audit_workdir(cfg, tmp_path)[1].ok


def test_a_resumed_run_redoes_the_evaluations_of_the_steps_it_trains_again(tmp_path,
                                                                          small_config):
    from dora_jax.rl.trainer import Trainer
    from dora_jax.runtime.loop import RunError

    class FailAt3(Trainer):
        def train_step(self, batch):
            if self.version == 3:
                raise FloatingPointError("injected failure in step 3")
            return super().train_step(batch)

    c = small_config("dora", validate=False, num_steps=4, checkpoint_every=2)
    c.eval.update(dict(every=2, num_prompts=4, samples=2, k=2))
    cfg = hf_checks.validated(c, num_devices=8)
    with pytest.raises(RunError):
        experiment.run(cfg, str(tmp_path), make_trainer=FailAt3)
    summary = experiment.run(cfg, str(tmp_path))
    assert summary["resumed_from_step"] == 2
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [m["step"] for m in lines if "eval" not in m] == [0, 1, 2, 3]
    assert [m["step"] for m in lines if "eval" in m] == [0, 2, 4]  # version 2 once
    # The summary's before and after are the whole run's: version 0 was evaluated
    # by the failed process, version 4 by the resumed one.
    assert (summary["eval_first"]["version"], summary["eval_last"]["version"]) == (0, 4)
    assert summary["steps"] == 4
    from dora_jax.runtime.tensorboard import read_scalars

    assert [s for s, _ in read_scalars(str(tmp_path / "tensorboard"))["eval/pass_at_1"]] \
        == [0, 2, 4]
    assert audit_workdir(cfg, tmp_path)[1].ok
