"""The asynchronous runtime end to end on 8 fake devices: DORA's own paths (several
versions resident, migrations, lag K) with the params every slice loads checked
against the trainer's, on-policy ratios in sync mode, a failing trainer, and rollout
batches larger than all the slots in every mode."""

import collections
import concurrent.futures
import threading
import time

import jax
import numpy as np
import pytest
from conftest import audit_workdir

from dora_jax.config import MODES
from dora_jax.model import hf_checks, layer_layout
from dora_jax.rl.trainer import Trainer
from dora_jax.rollout.slice import DecodeSlice
from dora_jax.runtime import experiment
from dora_jax.runtime.loop import RunError


def _host_leaves(params) -> list:
    return [np.asarray(x) for x in jax.device_get(jax.tree.leaves(params))]


class RecordingTrainer(Trainer):
    """Keeps a host copy of the params of every version it publishes (`published`),
    and as a slice lays them out (`per_layer`: each layer apart); `delay` seconds per
    step let decoding run ahead of training."""

    delay = 0.0
    fail_at_step = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.published, self.per_layer = {}, {}
        self._record()

    def _record(self):
        self.published[self.version] = _host_leaves(self.params)
        self.per_layer[self.version] = _host_leaves(
            layer_layout.unstack(self.cfg.model, self.params))

    def train_step(self, batch):
        if self.version == self.fail_at_step:
            raise FloatingPointError(f"injected failure in step {self.version}")
        time.sleep(self.delay)
        metrics = super().train_step(batch)
        self._record()
        return metrics


def _run(cfg, workdir, trainer_cls=RecordingTrainer):
    made = []

    def make_trainer(*args, **kwargs):
        made.append(trainer_cls(*args, **kwargs))
        return made[0]

    summary = experiment.run(cfg, str(workdir), make_trainer=make_trainer)
    return summary, made[0]


def _metrics(workdir) -> list:
    import json

    return [json.loads(line) for line in open(workdir / "metrics.jsonl")]


def test_dora_paths_with_a_sample_held_across_publishes(tmp_path, small_config,
                                                       monkeypatch):
    """Sample 0 of group 0 (version 0) does not decode until the trainer has
    published version 2, whatever the machine's pace (its slice stands still, by
    count, not by sleeps): DORA keeps version 0 resident on that slice while others
    load newer versions, the group is consumed at staleness K - 1 = 2 or more
    (admission keeps one step of K = 3 in reserve), and every slice loads exactly the
    params the trainer published."""
    import threading

    cfg = small_config("dora", max_staleness=3, train_batch_size=8, rollout_batch_size=32,
                       num_steps=6, rollout=dict(max_decode_len=16, decode_steps=1))
    loads = _loads_recorded(monkeypatch)
    published_2, step = threading.Event(), DecodeSlice.step
    held = []

    class Publishing(RecordingTrainer):
        def train_step(self, batch):
            metrics = super().train_step(batch)
            if self.version >= 2:
                published_2.set()
            return metrics

    def holding_step(self):
        if self.holds((0, 0)) and not published_2.is_set():
            held.append(self.slice_id)
            published_2.wait(0.005)  # decodes nothing: it stands still until then
            return []
        return step(self)

    monkeypatch.setattr(DecodeSlice, "step", holding_step)
    summary, trainer = _run(cfg, tmp_path, Publishing)

    events, report = audit_workdir(cfg, tmp_path)
    assert report.ok, report.summary()
    assert held, "the sample was never held"
    (group0,) = [e for e in events if e["event"] == "consume" and e["group_id"] == 0]
    assert group0["step"] - group0["version"] >= cfg.coordinator.max_staleness - 1, group0
    assert max(report.staleness) >= cfg.coordinator.max_staleness - 1, summary
    assert summary["max_resident_versions"] >= 2, summary
    loaded = {v for _, v, _ in loads}  # a slice may skip a version published meanwhile
    assert 0 in loaded and len(loaded) >= 3, loaded
    for slice_id, version, leaves in loads:
        want = trainer.per_layer[version]
        assert len(leaves) == len(want)
        assert all(np.array_equal(a, b) for a, b in zip(leaves, want)), (slice_id, version)


def test_sync_trains_on_policy(tmp_path, small_config):
    """In sync mode every sample comes from the trainer's current params: the PPO
    ratio pi_theta / pi_behaviour is 1 (publication, log-prob alignment, temperature)."""
    cfg = small_config("sync", num_steps=3, rollout=dict(temperature=0.7))
    _run(cfg, tmp_path)
    for m in _metrics(tmp_path):
        assert abs(m["trainer"]["ratio_min"] - 1) < 1e-3, m["trainer"]
        assert abs(m["trainer"]["ratio_max"] - 1) < 1e-3, m["trainer"]


def test_failing_trainer_stops_with_one_error_and_a_complete_ledger(tmp_path, small_config,
                                                                    monkeypatch):
    cfg = small_config("dora", num_steps=6)
    monkeypatch.setattr(RecordingTrainer, "fail_at_step", 2)
    with pytest.raises(RunError, match=r"the trainer failed at step 2: FloatingPointError: "
                                       r"injected failure in step 2"):
        _run(cfg, tmp_path)
    events, report = audit_workdir(cfg, tmp_path)
    # Steps 0 and 1 trained; every other admitted group is listed as unconsumed.
    assert report.steps == 2 and not (report.c1 or report.c2 or report.c3), report.summary()
    assert sum(e["event"] == "unconsumed" for e in events) == report.groups_admitted - 4


def test_a_slow_reward_holds_up_neither_the_coordinator_nor_other_groups(
        tmp_path, small_config, monkeypatch):
    """The last reward of the first group to finish is held back until K train steps
    have consumed other groups (a reward call near its time limit): the run goes on
    meanwhile, and trains the slow group once its rewards are in, by its deadline (K).
    A coordinator that waited on the slow group's rewards would stop at the first step
    that took the group, before K steps."""
    cfg = small_config("dora", max_staleness=2, rollout_batch_size=8, num_steps=6)
    hold_until = cfg.coordinator.max_staleness * cfg.coordinator.train_batch_size
    slow: dict = {}
    samples: collections.Counter = collections.Counter()
    ledger = tmp_path / "ledger.jsonl"

    def consumed_lines() -> int:
        return ledger.read_text().count('"event": "consume"') if ledger.exists() else 0

    class SlowFirstGroup(experiment.RewardPool):
        def submit_many(self, items):
            return [self._late(record, scored)
                    for (record, _), scored in zip(items, super().submit_many(items))]

        def _late(self, record, scored):
            samples[record["prompt_id"]] += 1
            if samples[record["prompt_id"]] < cfg.coordinator.group_size or slow:
                return scored
            slow["prompt_id"] = record["prompt_id"]
            late: concurrent.futures.Future = concurrent.futures.Future()

            def resolve():
                deadline = time.monotonic() + 60
                while consumed_lines() < hold_until and time.monotonic() < deadline:
                    time.sleep(0.05)
                slow["trained_before"] = consumed_lines()
                late.set_result(scored.result())
            threading.Thread(target=resolve, daemon=True).start()
            return late

    monkeypatch.setattr(experiment, "RewardPool", SlowFirstGroup)
    _run(cfg, tmp_path)
    events, report = audit_workdir(cfg, tmp_path)
    assert report.ok, report.summary()
    assert slow["trained_before"] >= hold_until  # K steps trained while it was held
    consumed = [e for e in events if e["event"] == "consume"]
    (late,) = [e for e in consumed if e["prompt_id"] == slow["prompt_id"]]
    assert late["step"] > min(e["step"] for e in consumed)
    assert late["step"] <= late["version"] + cfg.coordinator.max_staleness


@pytest.mark.slow
@pytest.mark.parametrize("factor", [2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_rollout_batch_beyond_all_slots(mode, factor, tmp_path, small_config):
    """rollout_batch_size x group_size = 2x and 4x the 16 slots: pending samples of
    old groups wait while slices move on; partial_rollout starts them on the newest
    version (recorded per token) and never mixes versions where C1 is kept."""
    cfg = small_config(mode, rollout_batch_size=16 * factor // 2, train_batch_size=2,
                       num_steps=3)
    _run(cfg, tmp_path)
    events, report = audit_workdir(cfg, tmp_path)
    assert report.ok and report.steps == 3, report.summary()


def test_colocated_sync_time_shares_every_device(tmp_path, small_config):
    """sync on the colocated layout: the trainer and the slices share all 8 devices
    and take turns (no decode span overlaps a train span); every slice reloads the
    trainer's params, resharded onto its own device. The trainer spans 8 devices:
    its batch needs 8 samples."""
    cfg = small_config("sync", colocated=True, train_batch_size=4, rollout_batch_size=4,
                       num_steps=3)
    summary, trainer = _run(cfg, tmp_path)
    _, report = audit_workdir(cfg, tmp_path)
    assert report.ok and report.steps == 3 and set(report.staleness) == {0}, report.summary()
    assert trainer.mesh.devices.size == 8 and cfg.mesh.num_slices == 8
    import json
    spans = json.load(open(tmp_path / "timeline.json"))
    train = [(s["start"], s["end"]) for s in spans if s["kind"] == "train"]
    decode = [(s["start"], s["end"]) for s in spans if s["kind"] == "decode"]
    assert len(train) == 3 and decode
    assert not [(d, t) for d in decode for t in train if d[0] < t[1] and t[0] < d[1]]
    assert summary["rollout_only_share"] > 0


def test_trainer_wait_is_split_by_cause(tmp_path, small_config):
    """Every step's recorded wait is exactly its fill + guard + starvation; only step
    0 waits for the pipeline to fill."""
    cfg = small_config("dora", num_steps=5)
    summary, _ = _run(cfg, tmp_path)
    records = _metrics(tmp_path)
    for m in records:
        split = m["trainer_wait_split"]
        assert abs(sum(split.values()) - m["trainer_wait"]) < 2e-3, m
        assert (split["fill"] > 0) == (m["step"] == 0), m
        # Per-slice prefill counters: every slice reported, each step's increase.
        assert set(m["prefill_tokens"]) == set(m["slot_utilisation"]), m
        assert min(m["prefill_tokens"].values()) >= 0 <= min(m["reprefill_tokens"].values())
    assert sum(sum(m["prefill_tokens"].values()) for m in records) > 0
    s = summary["trainer_wait_split"]
    assert s["fill_seconds"] == records[0]["trainer_wait_split"]["fill"]
    assert abs(s["guard"] + s["starvation"] - summary["trainer_wait_fraction"]) < 2e-3


def test_rollout_only_share_and_wait_clock_by_hand():
    from dora_jax.base.timeline import Span
    from dora_jax.runtime.report import WaitClock, rollout_only_share

    spans = [Span("slice 0", "decode", 0.0, 4.0, 0), Span("slice 1", "decode", 3.0, 6.0, 0),
             Span("slice 0", "load", 6.0, 7.0, 1), Span("trainer", "train", 2.0, 5.0, 0),
             Span("slice 0", "decode", 8.0, 9.0, 1), Span("trainer", "train", 8.5, 10.0, 1)]
    # Window [1, 10]: decoding on [1, 6] + [8, 9], training on [2, 5] + [8.5, 10]:
    # rollout only on [1, 2] + [5, 6] + [8, 8.5] = 2.5 of 9.
    assert rollout_only_share(spans, 1.0, 10.0) == round(2.5 / 9, 4)
    assert rollout_only_share(spans, 3.0, 3.0) is None

    clock = WaitClock()
    clock.mark(0.0, "fill")
    clock.mark(1.0, "fill")
    assert clock.take(1.5) == {"fill": 1.5, "guard": 0.0, "starvation": 0.0}
    clock.mark(1.7, None)  # busy: not counted
    clock.mark(2.0, "starvation")
    clock.mark(2.5, "guard")
    clock.mark(2.75, "starvation")
    assert clock.take(3.0) == {"fill": 0.0, "guard": 0.25, "starvation": 0.75}


def test_dynamic_sampling_filters_and_replaces_groups(tmp_path, small_config):
    """DAPO's dynamic sampling in a dora run with the decoupled objective: every
    other prompt rewards any response alike (modulus 1), so its groups have zero
    reward variance and leave through `filter` records; they are replaced (every step
    still trains TBS groups, the audit is clean, no filtered group is consumed), and
    the trainer reports the engine mismatch of the tokens its own version sampled."""
    from dora_jax.tasks.sources import prompt_records

    c = small_config("dora", validate=False, num_steps=4)
    c.trainer.update(dict(filter_zero_variance=True, objective="decoupled", is_cap=2.0))
    cfg = hf_checks.validated(c, num_devices=8)
    records = [dict(r, modulus=1, target=0) if i % 2 == 0 else r
               for i, r in enumerate(prompt_records(cfg)[0])]
    made = []
    summary = experiment.run(cfg, str(tmp_path), records=records,
                             make_trainer=lambda *a, **k: made.append(Trainer(*a, **k)) or made[0])
    events, report = audit_workdir(cfg, tmp_path)
    assert report.ok, report.summary()
    filtered = [e for e in events if e["event"] == "filter"]
    assert filtered and all(e["reason"] == "zero reward variance" for e in filtered)
    assert summary["groups_filtered"] == len(filtered)
    constant = {r["prompt_id"] for r in records if r["modulus"] == 1}
    assert {e["prompt_id"] for e in filtered} & constant
    for e in events:
        if e["event"] == "consume":
            assert len({s["reward"] for s in e["samples"]}) > 1
    metrics = _metrics(tmp_path)
    fresh = [m["trainer"] for m in metrics if m["trainer"]["logprob_mismatch_tokens"] > 0]
    assert fresh and all(m["logprob_mismatch"] < 1e-3 for m in fresh)


def test_overlong_punishment_shapes_the_trained_rewards(small_config):
    """The rewards the trainer sees: the reward function's plus DAPO's punishment
    (max_decode_len 8, buffer 4: free up to 4 tokens, then -1/4 per token)."""
    import concurrent.futures
    import types

    from dora_jax.runtime.groups import Group

    c = small_config("dora", validate=False)
    c.trainer.update(dict(overlong_buffer=4, overlong_penalty=2.0))
    cfg = hf_checks.validated(c, num_devices=8)
    g = Group(record={}, version=0)
    for k, n in enumerate([3, 5, 8]):
        g.trajectories[k] = types.SimpleNamespace(response_tokens=[7] * n)
        g.rewards[k] = concurrent.futures.Future()
        g.rewards[k].set_result((1.0, None))
    shaped, penalties = g.shape(cfg)
    assert shaped == pytest.approx([1.0, 0.5, -1.0])
    assert penalties == pytest.approx([0.0, -0.5, -2.0])


def test_a_failed_run_resumes_and_the_whole_ledger_audits(tmp_path, small_config):
    """A trainer that fails at step 3 stops the run; the same config on the same
    workdir (its step count raised) resumes from the newest checkpoint: finished
    groups kept, lost ones admitted again, voided training redone. Then the complete
    run is not trained again, and another config is refused there."""

    def cfg_with(steps, mode="dora"):
        c = small_config(mode, validate=False, num_steps=steps, checkpoint_every=2)
        return hf_checks.validated(c, num_devices=8)

    class FailAt3(RecordingTrainer):
        fail_at_step = 3

    with pytest.raises(RunError):
        _run(cfg_with(6), tmp_path, FailAt3)
    summary, trainer = _run(cfg_with(6), tmp_path)
    assert summary["resumed_from_step"] == 2 and trainer.version == 6
    events, report = audit_workdir(cfg_with(6), tmp_path)
    assert report.ok, report.summary() + str(report.c2[:3])
    assert report.steps == 6 and sum(e["event"] == "resume" for e in events) == 1
    assert [m["step"] for m in _metrics(tmp_path)] == list(range(6))
    # TensorBoard shows what metrics.jsonl holds: the crashed run's step 2 purged.
    from dora_jax.runtime.tensorboard import read_scalars

    board = read_scalars(str(tmp_path / "tensorboard"))
    assert board["reward_mean"] == [(m["step"], pytest.approx(m["reward_mean"]))
                                    for m in _metrics(tmp_path)]
    assert [s for s, _ in board["trainer/loss"]] == list(range(6))
    again = experiment.run(cfg_with(6), str(tmp_path))
    assert again["already_trained"] == 6
    from dora_jax.config import ConfigError
    with pytest.raises(ConfigError, match="coordinator.mode: 'dora' -> 'sync'"):
        experiment.run(cfg_with(6, "sync"), str(tmp_path))
    fresh = experiment.run(cfg_with(2, "sync"), str(tmp_path), fresh=True)
    assert "resumed_from_step" not in fresh
    assert audit_workdir(cfg_with(2, "sync"), tmp_path)[1].ok
    assert [s for s, _ in read_scalars(str(tmp_path / "tensorboard"))["reward_mean"]] == [0, 1]


def test_a_resumed_runs_summary_covers_the_whole_run(tmp_path, small_config):
    """A run failed in step 3 and resumed from its checkpoint of step 2 sums up as the
    same 6 steps run straight through: steps counted from 0, every group consumed;
    its wall time is its two segments', its tokens and staleness every step's in
    metrics.jsonl, not the resumed segment's alone."""
    import json

    cfg = small_config("dora", num_steps=6, checkpoint_every=2)
    tbs = cfg.coordinator.train_batch_size

    class FailAt3(RecordingTrainer):
        fail_at_step = 3

    with pytest.raises(RunError):
        _run(cfg, tmp_path / "resumed", FailAt3)
    resumed, _ = _run(cfg, tmp_path / "resumed")
    straight, _ = _run(cfg, tmp_path / "straight")
    assert resumed["resumed_from_step"] == 2
    for key in ("steps", "groups_consumed", "groups_filtered", "slice_failures"):
        assert resumed[key] == straight[key], key
    assert resumed["steps"] == 6 and resumed["groups_consumed"] == 6 * tbs
    assert [(x["from_step"], x["steps"]) for x in resumed["segments"]] == [(0, 2), (2, 4)]
    assert [(x["from_step"], x["steps"]) for x in straight["segments"]] == [(0, 6)]
    for summary in (resumed, straight):
        assert all(x["wall_seconds"] > 0 for x in summary["segments"])
        assert summary["wall_seconds"] == pytest.approx(
            sum(x["wall_seconds"] for x in summary["segments"]), abs=2e-3)
    # The resumed segment alone: after step 2's end in its own clock.
    assert resumed["wall_seconds"] > resumed["segments"][1]["wall_seconds"]
    metrics = [m for m in _metrics(tmp_path / "resumed") if "eval" not in m]
    assert [m["step"] for m in metrics] == list(range(6))
    assert resumed["trained_tokens"] == sum(m["trained_tokens"] for m in metrics)
    assert resumed["trained_tokens"] > sum(m["trained_tokens"] for m in metrics[2:])
    assert sum(resumed["staleness"].values()) == 6 * tbs
    assert resumed["reward_first"] == round(metrics[0]["reward_mean"], 4)
    on_disk = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert on_disk["steps"] == 6 and on_disk["segments"] == resumed["segments"]


@pytest.mark.parametrize("mode", ["dora", "sync"])
def test_a_failing_slice_is_restarted_and_nothing_is_lost(mode, tmp_path, small_config):
    """Slice 0, where the first groups go, raises at its first generate call, holding
    samples (the fault plan: coordinator.fail_slice, fail_point="generate"): the run
    goes on, the slice's
    samples are regenerated, the restarted slice loads the version it is told, the
    ledger and metrics.jsonl record the failure, and the whole ledger audits clean."""
    cfg = small_config(mode, num_steps=5, fail_slice=0, fail_point="generate")
    summary, _ = _run(cfg, tmp_path)
    events, report = audit_workdir(cfg, tmp_path)
    assert report.ok, report.summary() + str(report.c2[:3])
    assert report.steps == 5 and summary["slice_failures"] == 1
    (failed,) = [e for e in events if e["event"] == "slice_failed"]
    assert failed["slice"] == 0 and "injected failure" in failed["error"]
    assert failed["regenerated"] > 0  # it held samples when it failed
    assert sum(m["slice_failures"] for m in _metrics(tmp_path)) == 1


def test_a_slice_failing_past_the_restart_limit_stops_the_run(tmp_path, small_config):
    cfg = small_config("dora", num_steps=4, fail_slice=0, fail_point="generate",
                       max_slice_restarts=0)
    with pytest.raises(RunError, match="slice 0 failed .*InjectedFault"):
        _run(cfg, tmp_path)
    events, report = audit_workdir(cfg, tmp_path)
    assert report.ok, report.summary()  # every admitted group is still accounted for


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "partial_rollout",
                                  "partial_rollout_rounds", "dora"])
def test_a_finite_prompt_set_is_trained_to_its_end(mode, tmp_path, small_config):
    """Eight prompts, one epoch, two groups a step, more steps asked for than the data
    allows: the run ends cleanly after four steps with every admitted group consumed
    (not merely declared unconsumed at exit), each prompt admitted exactly once."""
    c = small_config(mode, num_steps=10, validate=False)
    c.data.num_prompts, c.data.num_epochs = 8, 1
    cfg = hf_checks.validated(c, num_devices=8)
    summary, _ = _run(cfg, tmp_path)
    events, report = audit_workdir(cfg, tmp_path)
    assert report.ok, report.summary()
    assert summary["steps"] == 4 and summary["prompts_exhausted"]
    admitted = [e["group_id"] for e in events if e["event"] == "admit"]
    consumed = [e["group_id"] for e in events if e["event"] == "consume"]
    assert sorted(admitted) == sorted(consumed) == list(range(8))
    assert len({e["prompt_id"] for e in events if e["event"] == "admit"}) == 8
    assert not [e for e in events if e["event"] == "unconsumed"]


def test_a_stalled_run_stops_with_what_each_part_was_doing(tmp_path, small_config,
                                                           monkeypatch):
    """A slice whose generate call never returns (a lost event, as far as the
    coordinator can tell): past coordinator.stall_timeout the run stops with a
    RunError naming the stall and every slice's and the trainer's activity, and the
    ledger still accounts for every admitted group."""
    import threading

    from dora_jax.rollout.slice import DecodeSlice

    release, hung = threading.Event(), []
    real_step = DecodeSlice.step

    def step(self):
        if not hung and self.version == 1 and self.num_requests:
            hung.append(self.slice_id)  # the first slice to decode version 1 hangs
            release.wait(60)  # until the test ends
        return real_step(self)

    monkeypatch.setattr(DecodeSlice, "step", step)
    cfg = small_config("sync", num_steps=6, stall_timeout=3.0)
    try:
        with pytest.raises(RunError, match=r"stalled at step \d+: no event for "
                           r"coordinator.stall_timeout=3 s") as err:
            _run(cfg, tmp_path)
    finally:
        release.set()
    message = str(err.value)
    assert f"slice {hung[0]}: decoding" in message, message
    assert "trainer: waiting for a batch" in message, message
    _, report = audit_workdir(cfg, tmp_path)
    assert report.ok, report.summary()



def _loads_recorded(monkeypatch) -> list:
    """(slice id, version, host leaves) of every load a slice completes."""
    loads, load_version = [], DecodeSlice.load_version

    def recording_load(self, version, params):
        seconds = load_version(self, version, params)
        loads.append((self.slice_id, version, _host_leaves(self.params.leaves)))
        return seconds

    monkeypatch.setattr(DecodeSlice, "load_version", recording_load)
    return loads


def test_a_slice_failing_during_a_weight_load(tmp_path, small_config, monkeypatch):
    """Slice 1 raises while placing its second version's params (fault plan
    "load"): it held nothing (sync loads empty slices), so nothing is regenerated;
    restarted, it loads again, and every completed load equals by content the params
    the trainer published for that version."""
    loads = _loads_recorded(monkeypatch)
    cfg = small_config("sync", num_steps=4, fail_slice=1, fail_point="load", fail_after=1)
    summary, trainer = _run(cfg, tmp_path)
    events, report = audit_workdir(cfg, tmp_path)
    assert report.ok, report.summary()
    (failed,) = [e for e in events if e["event"] == "slice_failed"]
    assert failed["slice"] == 1 and "injected failure at load" in failed["error"]
    assert failed["regenerated"] == 0 and failed["in_hand_over"] == 0
    assert summary["steps"] == 4 and summary["slice_failures"] == 1
    slice1 = [v for i, v, _ in loads if i == 1]
    assert slice1[:2] == [0, 1] and len(slice1) >= 3, slice1  # 0 at start, 1, then again
    for slice_id, version, leaves in loads:
        want = trainer.per_layer[version]
        assert len(leaves) == len(want)
        assert all(np.array_equal(a, b) for a, b in zip(leaves, want)), (slice_id, version)


def _forced_migrations(monkeypatch) -> list:
    """DORA's own plan, plus at most one migration per decision wherever a serving
    slice's running samples all fit in the free slots of another slice of the same
    version, until a slice has failed: the run reaches the migration fault points by
    construction, not by pacing. Each forced move is a legal DORA action
    (`Scheduler.do_migrate`), so the audit judges the run as any other. Returns the
    list of (group, sample, src, dst) moves forced."""
    from dora_jax.scheduler.core import Scheduler
    from dora_jax.scheduler.dora import DoraPolicy

    forced, failed, plan, decide = [], [], DoraPolicy.plan, Scheduler.decide
    slice_failed = Scheduler.slice_failed
    this_decision = []

    def forcing_plan(self, sched):
        if not failed and not this_decision:
            serving = [sl for sl in sched.slices if sl.serving]
            for src in sorted(serving, key=lambda sl: len(sl.running)):
                dst = [d for d in serving if d is not src and d.version == src.version
                       and src.running and sched.free_slots(d) >= len(src.running)]
                if dst:
                    for gid, k in sorted(src.running):
                        forced.append((gid, k, src.slice_id, dst[0].slice_id))
                        this_decision.append(sched.do_migrate(gid, k, dst[0].slice_id))
                    return list(this_decision) + plan(self, sched)
        return plan(self, sched)

    def deciding(self):
        this_decision.clear()
        return decide(self)

    def failing(self, slice_id):
        failed.append(slice_id)
        return slice_failed(self, slice_id)

    monkeypatch.setattr(DoraPolicy, "plan", forcing_plan)
    monkeypatch.setattr(Scheduler, "decide", deciding)
    monkeypatch.setattr(Scheduler, "slice_failed", failing)
    return forced


def test_migrated_samples_continue_where_they_left_off(tmp_path, small_config, monkeypatch):
    """Migrations forced wherever legal (`_forced_migrations`), nothing failing: each
    moved sample leaves its source with its KV cache and finishes on its destination
    under its group's version; the consume lines list both slices for it, and the
    ledger audits clean."""
    forced = _forced_migrations(monkeypatch)
    cfg = small_config("dora", num_steps=4, rollout=dict(max_decode_len=16, decode_steps=1))
    summary, _ = _run(cfg, tmp_path)
    events, report = audit_workdir(cfg, tmp_path)
    assert report.ok, report.summary()
    assert forced and summary["migrations"] >= 1, (forced, summary)
    samples = {(e["group_id"], k): s for e in events if e["event"] == "consume"
               for k, s in enumerate(e["samples"])}
    moved = 0
    for g, k, src, dst in forced:
        if (g, k) not in samples:
            continue  # not consumed by the end of the run
        # It moved; or it had finished on its source before the export came; or the
        # export found nothing to carry and it was generated again from scratch.
        path = samples[(g, k)]["slices"]
        moved += (src, dst) in list(zip(path, path[1:]))
    assert moved >= 1, (forced, summary)


@pytest.mark.parametrize("point", ["export", "import"])
def test_a_slice_failing_with_a_migration_in_flight(point, tmp_path, small_config,
                                                    monkeypatch):
    """The first slice to start a migration out ("export": its hand-over never
    filled) or to receive one ("import": the requests arrived) raises there. The
    migrating samples are regenerated — on export through the released hand-over
    (`in_hand_over`), on import as the destination's own — and the run finishes with
    its ledger audited clean. Migrations are forced where legal
    (`_forced_migrations`), so the point is reached whatever the machine's pace."""
    forced = _forced_migrations(monkeypatch)
    cfg = small_config("dora", num_steps=6, rollout=dict(max_decode_len=16, decode_steps=1),
                       fail_slice=-2, fail_point=point, stall_timeout=20.0)
    summary, _ = _run(cfg, tmp_path)
    events, report = audit_workdir(cfg, tmp_path)
    assert report.ok, report.summary()
    assert forced, summary
    # On export the failing slice raises before its requests leave: none migrated.
    assert (summary["migrations"] >= 1) == (point == "import"), summary
    (failed,) = [e for e in events if e["event"] == "slice_failed"]
    assert f"injected failure at {point}" in failed["error"]
    if point == "export":
        assert failed["in_hand_over"] >= 1, failed
    assert failed["regenerated"] >= 1, failed
    assert summary["steps"] == 6 and summary["slice_failures"] == 1


def test_a_minimum_interval_leaves_the_save_at_the_end_alone(tmp_path, small_config):
    """A save every step, but at most one an hour: the steps train without a save
    and the run's end still saves its last version."""
    from dora_jax.model.checkpointing import Checkpointer

    cfg = small_config("dora", num_steps=3, checkpoint_every=1, checkpoint_min_seconds=3600)
    summary, _ = _run(cfg, tmp_path)
    assert summary["steps"] == 3
    with Checkpointer(tmp_path / "checkpoints", max_to_keep=None) as ckpt:
        assert ckpt.all_steps() == [3]
    assert all(m["checkpoint_pause_s"] == 0 for m in _metrics(tmp_path))


def test_checkpoints_are_saved_off_the_coordinator_and_hold_each_versions_params(
        tmp_path, small_config, monkeypatch):
    """A save every step, each on the saver thread (the coordinator only hands it
    over): every checkpoint holds exactly the params the trainer published for its
    version, although the trainer's next step donates those buffers (it waits for
    the save's copy first), and metrics.jsonl says what each save cost the run."""
    import threading

    from dora_jax.model.checkpointing import Checkpointer

    threads, save = [], Checkpointer.save

    def recording_save(self, step, state, extra=None, **kw):
        threads.append(threading.current_thread().name)
        return save(self, step, state, extra, **kw)

    monkeypatch.setattr(Checkpointer, "save", recording_save)
    cfg = small_config("dora", num_steps=4, checkpoint_every=1)
    summary, trainer = _run(cfg, tmp_path)
    assert set(threads[1:]) == {"checkpoint saves"}, threads  # [0]: the warm-up's
    with Checkpointer(tmp_path / "checkpoints", max_to_keep=None) as ckpt:
        steps = ckpt.all_steps()
        assert steps and steps[-1] == 4, steps
        for step in steps:
            saved = jax.tree.leaves(ckpt.restore_as_saved(step)["params"])
            want = trainer.published[step]
            assert len(saved) == len(want)
            assert all(np.array_equal(a, b) for a, b in zip(saved, want)), step
    records = _metrics(tmp_path)
    assert all(m["checkpoint_pause_s"] >= 0 and m["checkpoint_copy_wait_s"] >= 0
               for m in records)
