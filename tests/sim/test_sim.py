"""The cluster simulator: its cost model against hand-worked sums, its workload's
statistics, hand-worked step times of tiny clusters, the contract (C1-C3) audited in
every mode of a preset, the command line, and multi-turn episodes (a hand-worked
episode, their slot time, C1 per episode, partial rollout's mixed versions)."""

import dataclasses
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from dora_jax.scheduler.types import SchedulerConfig
from dora_jax.sim import PRESETS, SIM_MODES, CostModel, Workload, simulate
from dora_jax.sim.cluster import ClusterSim
from dora_jax.sim.episodes import Episode
from dora_jax.sim.slice import Request

ZERO = CostModel(step_fixed=0.0, step_per_seq=0.0, step_per_ctx=0.0, prefill_fixed=0.0,
                 prefill_per_token=0.0, weight_bytes=0.0, transfer_bandwidth=1.0,
                 transfer_latency=0.0, kv_bytes_per_token=0.0, migrate_bandwidth=1.0,
                 migrate_latency=0.0, kv_tokens=10**9, train_fixed=0.0, train_per_token=0.0)


def test_closed_form_decode_cost_equals_the_sum_of_its_steps():
    cost = dataclasses.replace(ZERO, step_fixed=0.02, step_per_seq=1e-4, step_per_ctx=3e-7)
    for k, batch, context in [(1, 1, 0), (7, 3, 100), (64, 256, 600_000)]:
        by_hand = sum(cost.step_seconds(batch, context + batch * i) for i in range(k))
        assert math.isclose(cost.steps_seconds(k, batch, context), by_hand, rel_tol=1e-12)


def test_workload_lengths_have_the_stated_mean_and_cap():
    w = Workload(mean_len=2400, max_len=30_720, seed=3)
    length = w.lengths(16)
    x = np.array([length(g, k) for g in range(3000) for k in range(16)])
    assert abs(x.mean() / 2400 - 1) < 0.05 and x.max() <= 30_720 and x.min() >= 1
    assert x.max() / x.mean() > 8  # long-tailed
    assert length(5, 3) == Workload(mean_len=2400, seed=3).lengths(16)(5, 3)
    assert Workload(replay=(4, 7)).lengths(2)(0, 1) == 7


def _one_group(cost, lengths, mode="sync", slots=2, prompt_len=2, steps=2):
    cfg = SchedulerConfig(mode=mode, num_slices=1, slots_per_slice=slots,
                          group_size=len(lengths), train_batch_size=1, rollout_batch_size=1,
                          max_staleness=0)
    sim = ClusterSim(cfg, cost, lambda g, k: lengths[k], prompt_len=prompt_len)
    sim.run(steps)
    return sim


def test_step_time_by_hand():
    """One slice, a group of two samples (4 and 10 tokens), 1 s per decode step and
    5 s per train step: each sync step takes 10 + 5 s (the shorter sample's slot
    idles); with a cost per context position instead (prompt 2 tokens, shared),
    decoding costs sum over the steps of the positions then held."""
    sim = _one_group(dataclasses.replace(ZERO, step_fixed=1.0, train_fixed=5.0), [4, 10])
    assert [m["time"] for m in sim.metrics] == [15.0, 30.0]
    # Per step: two busy slots for 4 s, then one for 6 s.
    assert sim.stats["busy_slot_seconds"] == 2 * (2 * 4 + 1 * 6)
    sim = _one_group(dataclasses.replace(ZERO, step_per_ctx=1.0), [3], slots=1)
    assert sim.metrics[0]["time"] == 2 + 3 + 4  # positions 2, 3, 4 held at each step


def test_where_the_time_went_by_hand():
    """The sync step of `test_step_time_by_hand` (samples of 10 and 4 tokens, 1 s per
    decode step, 5 s of training) explained: the trainer waits 10 s for each batch
    (filling the pipeline before step 0, starved after); of the 2 slots x 15 s, 14
    slot-seconds decode, the short sample's slot idles 6 s with RBS groups out, and
    both idle the 5 s of training because sync admits nothing then."""
    sim = _one_group(dataclasses.replace(ZERO, step_fixed=1.0, train_fixed=5.0), [10, 4])
    for m, cause in zip(sim.metrics, ("fill", "starvation")):
        assert m["trainer_wait"] == 10.0
        assert m["trainer_wait_split"] == dict(dict.fromkeys(("fill", "guard", "starvation"),
                                                             0.0), **{cause: 10.0})
        assert {k: x for k, x in m["slot_idle"].items() if x} == dict(
            busy=14.0, rbs_full=6.0, admission_closed=10.0)


@pytest.mark.parametrize("mode", ["one_step_off", "partial_rollout", "partial_rollout_rounds",
                                  "dora"])
def test_slot_time_and_trainer_wait_add_up(mode, tmp_path):
    """Every step's slot-seconds by state sum to slots x its duration, and its wait by
    cause to its wait, on a long-tailed preset where many states occur."""
    small = dataclasses.replace(PRESETS["paper64"], train_batch_size=16,
                                rollout_batch_size=32, group_size=4, slots_per_slice=16,
                                workload=Workload(mean_len=300, max_len=4000, seed=1))
    s = simulate(small, mode, 5, str(tmp_path))
    slots = small.num_slices * small.slots_per_slice
    then = 0.0
    for m in map(json.loads, open(tmp_path / "metrics.jsonl")):
        assert math.isclose(sum(m["slot_idle"].values()), slots * (m["time"] - then),
                            rel_tol=1e-3), m
        assert math.isclose(sum(m["trainer_wait_split"].values()), m["trainer_wait"],
                            abs_tol=1e-3), m
        then = m["time"]
    assert math.isclose(sum(s["slot_idle"].values()), 1.0, abs_tol=2e-3), s["slot_idle"]
    assert s["slot_idle"]["busy"] > 0.05 and sum(x > 0 for x in s["slot_idle"].values()) >= 4


def test_load_contention_and_trained_tokens():
    cost = dataclasses.replace(ZERO, weight_bytes=10.0, transfer_bandwidth=5.0,
                               transfer_latency=1.0, train_per_token=0.5)
    assert cost.load_seconds(1) == 3.0 and cost.load_seconds(2) == 5.0
    sim = _one_group(cost, [4, 10])
    assert sim.metrics[0]["trained_tokens"] == 4 + 10 + 2 * 2
    # Step 0 trains (4 + 10 + 4) x 0.5 s = 9 s, then the slice loads v1 in 3 s.
    assert sim.metrics[0]["time"] == 9.0 and sim.metrics[1]["time"] == 9.0 + 3.0 + 9.0


def test_step_time_bound_by_hand_and_never_beaten():
    """Every response 10 tokens after a 2-token prompt, G = 2, one slice of 2 slots:
    a decode step of 1 s makes 2 tokens, so the 20 tokens of a batch need 10 s; the
    trainer needs 5 s. With K = 0 the longest response (10 steps of 1 s) and the
    train step run in turn: 15 s, which a sync step takes exactly. With K = 2 that
    floor is 10 x 1 / 2 = 5 s and the rollout's 10 s binds. The tokens' mean
    context is 2 / G + (E[L^2]/E[L] - 1)/2 = 5.5 (the prompt stored once per group);
    at 0.1 s per position a full step takes 1 + 2 x 5.5 x 0.1 = 2.1 s, and a lone
    sequence's, at its mean context 2 + 4.5, 1.65 s."""
    preset = dataclasses.replace(PRESETS["paper64"], total_devices=16, trainer_devices=8,
                                 slice_devices=8, slots_per_slice=2, group_size=2,
                                 train_batch_size=1, rollout_batch_size=1, max_staleness=0,
                                 workload=Workload(prompt_len=2, replay=(10,)))
    cost = dataclasses.replace(ZERO, step_fixed=1.0, train_fixed=5.0)
    assert preset.step_time_bound(cost, groups=8) == dict(step=15.0, train=5.0, rollout=10.0,
                                                          latency=15.0)
    k2 = dataclasses.replace(preset, max_staleness=2)
    assert k2.step_time_bound(cost, groups=8) == dict(step=10.0, train=5.0, rollout=10.0,
                                                      latency=5.0)
    with_ctx = k2.step_time_bound(dataclasses.replace(cost, step_per_ctx=0.1), groups=8)
    assert math.isclose(with_ctx["rollout"], 10 * 2.1)
    assert math.isclose(with_ctx["latency"], 10 * 1.65 / 2)
    sim = _one_group(cost, [10, 10])
    assert [m["time"] for m in sim.metrics] == [15.0, 30.0]


@pytest.mark.parametrize("mode", SIM_MODES)
def test_every_mode_of_a_preset_audits_clean(mode, tmp_path):
    small = dataclasses.replace(PRESETS["paper64"], train_batch_size=16,
                                rollout_batch_size=24, group_size=4, slots_per_slice=16,
                                workload=Workload(mean_len=300, max_len=4000, seed=1))
    s = simulate(small, mode, 4, str(tmp_path))
    assert s["audit_ok"], s["audit"]
    assert s["steps"] == 4 and 0 < s["slot_utilisation"] <= 1
    ledger = [json.loads(line) for line in open(tmp_path / "ledger.jsonl")]
    consumed = [r for r in ledger if r["event"] == "consume"]
    assert len(consumed) == 4 * 16
    lengths = small.workload.lengths(4)
    assert all(smp["response_len"] == lengths(r["group_id"], smp["sample"])
               for r in consumed for smp in r["samples"])
    assert {r["step"] - r["version"] for r in consumed} <= set(range(small.max_staleness + 1)) \
        or mode == "partial_rollout_unbounded"
    for name in ("metrics.jsonl", "summary.json", "timeline.png", "timeline.json"):
        assert (tmp_path / name).exists()


def test_command_line_prints_the_comparison(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "dora_jax.sim", "--preset=paper64", "--steps=2",
         "--modes=sync,partial_rollout,dora", "--jobs=1", "--explain",
         f"--workdir={tmp_path}"],
        capture_output=True, text=True, check=True, timeout=600).stdout
    lines = out.strip().splitlines()
    assert lines[-4].startswith("bound: no policy beats ")
    assert lines[-3].startswith("dora/sync step-time speedup: ")
    assert lines[-2].startswith("dora/partial_rollout step-time speedup: ")
    assert lines[-1].startswith("dora rollout-only share: ")
    assert "FAIL" not in out and (tmp_path / "dora" / "ledger.jsonl").exists()
    explained = [line for line in lines if " trainer wait: guard " in line]
    assert [line.split()[0] for line in explained] == ["sync", "partial_rollout", "dora"]


def test_command_line_refuses_bad_input_with_one_line():
    for args, said in ((["--modes=sync,fast"], "--modes: unknown ['fast']"),
                       (["--steps=1"], "--steps must be >= 2"),
                       (["--preset=paper64", "--trainer_devices=30"], "--trainer_devices must"),
                       (["--rollout_batch_size=100"], "--rollout_batch_size must be >= TBS")):
        out = subprocess.run([sys.executable, "-m", "dora_jax.sim", *args],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and said in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "dora_jax.sim.validate", "--workdir=/nonexistent"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "not a bench.modes output" in out.stderr


@pytest.mark.slow
def test_presets_reproduce_the_papers_fixed_schedules():
    """The H800 presets' fitted efficiencies (`sim.fit`) put the schedules that leave
    a scheduler no freedom (colocated sync at 64 and 128 GPUs, one-step-off at 64)
    within 15% of the paper's step times (presets.PAPER_64 / PAPER_128)."""
    from dora_jax.sim.fit import FIT_ON, paper_errors

    errors = paper_errors(PRESETS["paper64"].efficiency, steps=12)
    assert [(e[0], e[1]) for e in errors] == list(FIT_ON)
    assert max(abs(e[-1]) for e in errors) <= 0.15, errors


def test_calibration_recovers_known_costs_including_prefill():
    """Four slices whose busy time is 10 ms a generate call + 2 ms a decode step +
    0.5 ms a sequence-step + 0.1 ms a prefilled token (prompts and re-prefills as
    metrics.jsonl counts them, here half of each): the fit gives back those four
    costs. Without re-prefills the prefill cost is not fitted (it cannot be told
    from the decode work it grows with)."""
    from dora_jax.sim.calibrate import fit

    slots, spans, ledger, t = 4, [], [], 0.0
    util, prefilled = {}, {}
    for i, (calls, u, n_samples, pre) in enumerate([(10, 1.0, 20, 3000), (20, 0.5, 12, 500),
                                                    (15, 0.75, 30, 9000), (30, 0.25, 8, 100)]):
        tokens = n_samples * 9  # responses of 10 tokens, the first from the prefill
        ledger += [dict(event="consume", samples=[dict(response_len=10, slices=[i])])
                   for _ in range(n_samples)]
        steps = tokens / (u * slots)
        busy = 0.010 * calls + 0.002 * steps + 0.0005 * steps * u * slots + 1e-4 * pre
        for _ in range(calls):
            spans.append(dict(row=f"slice {i}", kind="decode", start=t, end=t + busy / calls))
            t += busy / calls
        util[str(i)], prefilled[str(i)] = u, pre
    spans.append(dict(row="trainer", kind="train", start=t, end=t + 1.0))
    half = {sl: n // 2 for sl, n in prefilled.items()}
    metrics = [dict(time=t + 1.0, slot_utilisation=util, prefill_tokens=half,
                    reprefill_tokens=half, trainer=dict(sequence_tokens=100))]
    cost = fit([dict(spans=spans, metrics=metrics, ledger=ledger)], slots)
    assert (cost.call_overhead, cost.step_fixed, cost.step_per_seq,
            cost.prefill_per_token) == pytest.approx((0.010, 0.002, 0.0005, 1e-4), rel=1e-6)
    metrics[0].update(prefill_tokens=prefilled, reprefill_tokens=dict.fromkeys(util, 0))
    assert fit([dict(spans=spans, metrics=metrics, ledger=ledger)], slots).prefill_per_token == 0


# ------------------------------------------------------------------ multi-turn episodes

def _small_multiturn():
    return dataclasses.replace(PRESETS["multiturn"], train_batch_size=16,
                               rollout_batch_size=24, group_size=4, slots_per_slice=16)


def test_episode_finishes_when_worked_by_hand():
    """One episode of three model turns (3, 4, 2 tokens) with observations of 5 and 6
    tokens after environments of 0.5 s and 1.5 s, on one slice of two slots: a decode
    step costs 1 s + 0.01 s per position held (the 2-token prompt included), a
    prefilled token 0.1 s, a train step 5 s. The positions held at each step are
    2, 3, 4 (turn 1); 10..13 (prompt, 3 + 5 response positions, then turn 2); 20, 21
    (2 + 3 + 5 + 4 + 6, then turn 3). The prompt's prefill (0.2 s) starts turn 1; the
    observations' prefills (0.5 s, 0.6 s) start turns 2 and 3, on the kept KV."""
    cost = dataclasses.replace(ZERO, step_fixed=1.0, step_per_ctx=0.01, prefill_per_token=0.1,
                               train_fixed=5.0)
    ep = Episode(model=(3, 4, 2), observations=(5, 6), latencies=(0.5, 1.5))
    cfg = SchedulerConfig(mode="sync", num_slices=1, slots_per_slice=2, group_size=1,
                          train_batch_size=1, rollout_batch_size=1, max_staleness=0)
    sim = ClusterSim(cfg, cost, None, prompt_len=2, episode=lambda g, k: ep)
    sim.run(2)
    turn1 = sum(1 + 0.01 * c for c in (2, 3, 4))
    turn2 = sum(1 + 0.01 * c for c in (10, 11, 12, 13))
    turn3 = sum(1 + 0.01 * c for c in (20, 21))
    rollout = 0.2 + turn1 + 0.5 + 0.5 + turn2 + 1.5 + 0.6 + turn3
    assert math.isclose(rollout, 13.26)
    assert [round(m["time"], 9) for m in sim.metrics] == [round(rollout + 5, 9),
                                                           round(2 * (rollout + 5), 9)]
    m = sim.metrics[0]
    assert m["trained_tokens"] == 2 + 3 + 5 + 4 + 6 + 2 and m["generated_tokens"] == 9
    # The episode's slot waits 2 s for its environments, the other idles with the
    # group out (RBS reached), both while the trainer trains.
    expected = dict(busy=turn1 + turn2 + turn3, prefill=0.2 + 0.5 + 0.6, env=2.0,
                    rbs_full=rollout, admission_closed=2 * 5.0)
    assert {k: x for k, x in m["slot_idle"].items() if x} == pytest.approx(expected, abs=2e-3)
    consumed = [r for r in sim.ledger if r["event"] == "consume"]
    assert consumed[0]["samples"] == [dict(sample=0, versions=[[0, 20]], slices=[0],
                                           response_len=20, finish="eos",
                                           turns=[["model", 0, 3], ["env", 3, 8, 0.5],
                                                  ["model", 8, 12], ["env", 12, 18, 1.5],
                                                  ["model", 18, 20]],
                                           observation_tokens=11)]


def test_observation_after_a_reload_reprefills_the_whole_sequence():
    """A parked episode takes its observation by prefilling its tokens, unless a
    reload while it waited (partial rollout) asks for the whole sequence again."""
    ep = Episode(model=(3, 4), observations=(5,), latencies=(1.0,))
    fresh = Request(0, 0, 0, 0, 0, ep)
    fresh.produced, fresh.turn = 3, 1
    fresh.take_observation()
    assert (fresh.produced, fresh.reprefill) == (8, 5)
    reloaded = Request(0, 0, 0, 0, 0, ep)
    reloaded.produced, reloaded.turn, reloaded.reprefill = 3, 1, 3
    reloaded.take_observation()
    assert (reloaded.produced, reloaded.reprefill) == (8, 8)


def test_multiturn_workload_shape_and_single_turn_unchanged():
    w = PRESETS["multiturn"].workload
    episode, length = w.episodes(16), w.lengths(16)
    eps = [episode(g, k) for g in range(500) for k in range(16)]
    turns = np.array([len(e.model) for e in eps])
    assert 3 < turns.mean() < 5 and turns.max() <= w.turns.max_turns and (turns == 1).any()
    assert (turns >= 12).mean() < 0.05  # a few episodes run many turns
    latencies = np.concatenate([e.latencies for e in eps])
    assert 0.08 < np.median(latencies) < 0.12 and latencies.max() <= w.turns.max_env
    assert all(len(e.observations) == len(e.latencies) == len(e.model) - 1 for e in eps)
    assert max(e.response_len for e in eps) <= w.turns.max_response
    assert length(7, 3) == sum(episode(7, 3).model)
    single = Workload(mean_len=2400, seed=3)
    assert single.episodes(16)(5, 3) == Episode((single.lengths(16)(5, 3),))


def _episodes_of(ledger):
    return [s for r in ledger if r["event"] == "consume" for s in r["samples"]
            if s.get("turns")]


def test_dora_keeps_each_episode_on_one_version_with_several_live():
    s = simulate(_small_multiturn(), "dora", 6)
    assert s["audit_ok"], s["audit"]  # audited with C1: one version per sample and group
    assert len(s["staleness"]) >= 3  # groups of several versions consumed side by side


def test_partial_rollout_episodes_mix_versions(tmp_path):
    s = simulate(_small_multiturn(), "partial_rollout", 5, str(tmp_path))
    assert s["audit_ok"] and s["interrupts"] > 0
    ledger = [json.loads(line) for line in open(tmp_path / "ledger.jsonl")]
    mixed = [e for e in _episodes_of(ledger) if len({v for v, _ in e["versions"]}) > 1]
    assert mixed and all(sum(n for _, n in e["versions"]) == e["response_len"] for e in mixed)


@pytest.mark.parametrize("mode", SIM_MODES)
def test_multiturn_preset_runs_in_every_mode_and_loses_nothing(mode, tmp_path):
    preset = _small_multiturn()
    s = simulate(preset, mode, 4, str(tmp_path))
    assert s["audit_ok"], s["audit"]  # every admitted group consumed or listed unconsumed
    ledger = [json.loads(line) for line in open(tmp_path / "ledger.jsonl")]
    consumed = [r for r in ledger if r["event"] == "consume"]
    assert len(consumed) == 4 * preset.train_batch_size
    episode = preset.workload.episodes(preset.group_size)
    for r in consumed:
        for smp in r["samples"]:
            ep = episode(r["group_id"], smp["sample"])
            assert smp["response_len"] == ep.response_len
            assert smp.get("turns", [["model", 0, ep.response_len]]) == ep.turn_ranges()
            assert smp.get("observation_tokens", 0) == sum(ep.observations)
    assert math.isclose(sum(s["slot_idle"].values()), 1.0, abs_tol=2e-3), s["slot_idle"]
    assert s["slot_idle"]["env"] > 0
    assert s["generated_tokens_per_second"] < s["tokens_per_second"]


def test_command_line_compares_modes_on_the_multiturn_preset():
    out = subprocess.run(
        [sys.executable, "-m", "dora_jax.sim", "--preset=multiturn", "--steps=2",
         "--modes=sync,partial_rollout,dora", "--jobs=1"],
        capture_output=True, text=True, check=True, timeout=600).stdout
    lines = out.strip().splitlines()
    assert "gen tok/s" in lines[1]
    rows = [line.split() for line in lines[2:5]]
    assert [r[0] for r in rows] == ["sync", "partial_rollout", "dora"]
    assert all(r[-2] == "ok" for r in rows)
    assert lines[-3].startswith("dora/sync step-time speedup: ")


def test_an_moe_requests_routing_moves_with_it():
    """A migration moves the KV and, for an MoE policy, the recorded routing: 384 bytes
    a token at Qwen3-30B-A3B's 48 layers x top-8 (configs/moe.py), beside 98,304 of KV."""
    cost = PRESETS["v5p"].cost()
    assert cost.routing_bytes_per_token == 48 * 8
    no_routing = dataclasses.replace(cost, routing_bytes_per_token=0.0)
    extra = cost.migrate_seconds(1000) - no_routing.migrate_seconds(1000)
    assert extra == pytest.approx(1000 * 384 / cost.migrate_bandwidth)
    assert PRESETS["paper64"].cost().routing_bytes_per_token == 0.0  # dense
