"""Slices holding more multi-turn episodes than slots (release.py): hand-worked
timings with the KV kept on device and on host, the slice's invariants checked at
every chunk start, the ledger audited in every mode, the slow-tool presets, and the
knob's validation."""

import dataclasses
import subprocess
import sys

import pytest

from dora_jax.scheduler.types import SchedulerConfig
from dora_jax.sim import PRESETS, SIM_MODES, CostModel, simulate
from dora_jax.sim.cluster import ClusterSim
from dora_jax.sim.episodes import Episode

ZERO = CostModel(step_fixed=0.0, step_per_seq=0.0, step_per_ctx=0.0, prefill_fixed=0.0,
                 prefill_per_token=0.0, weight_bytes=0.0, transfer_bandwidth=1.0,
                 transfer_latency=0.0, kv_bytes_per_token=0.0, migrate_bandwidth=1.0,
                 migrate_latency=0.0, kv_tokens=10**9, train_fixed=0.0, train_per_token=0.0)
EP = Episode(model=(2, 2), observations=(1,), latencies=(10.0,))


def _two_episodes(episodes_per_slice, cost=None, host_kv=False):
    """Two groups of one episode each (turns of 2 and 2 tokens, a 10 s environment
    between them) on one slice of one slot; 1 s a decode step, 5 s a train step."""
    cost = cost or dataclasses.replace(ZERO, step_fixed=1.0, train_fixed=5.0)
    cfg = SchedulerConfig(mode="sync", num_slices=1, slots_per_slice=1, group_size=1,
                          train_batch_size=2, rollout_batch_size=2, max_staleness=0,
                          episodes_per_slice=episodes_per_slice)
    sim = ClusterSim(cfg, cost, None, prompt_len=2, episode=lambda g, k: EP, host_kv=host_kv)
    sim.run(1)
    return sim


def test_released_slot_decodes_the_other_episode_by_hand():
    """Held: episode A decodes 0-2, waits 2-12 in its slot, decodes 12-14; B then
    14-16, 16-26, 26-28; training ends at 33. Released: B takes the slot A gave up
    (2-4), A re-enters when its observation arrives (12-14), B at 14-16 (its
    observation came with A's turn in flight): training ends at 21, and no slot time
    is `env`."""
    held = _two_episodes(0)
    assert held.metrics[0]["time"] == 33.0
    assert held.metrics[0]["slot_idle"]["env"] == 20.0
    released = _two_episodes(2)
    assert released.metrics[0]["time"] == 21.0
    idle = {k: x for k, x in released.metrics[0]["slot_idle"].items() if x}
    # 4-12 both episodes at their environments, RBS groups out; 16-21 training.
    assert idle == dict(busy=8.0, rbs_full=8.0, admission_closed=5.0)


def test_host_offload_delays_reentry_by_bytes_over_bandwidth():
    """As above with 1 byte of KV a position over a host link of 0.5 B/s: each copy
    of an episode's 2 response positions takes 4 s, one at a time each way. A's KV
    leaves at 2-6, B's at 6-10; A's observation (12) waits for its copy back 12-16,
    B's (14) for A's then its own, 16-20: A decodes 16-18, B 20-22, training ends at
    27 (21 with the KV on device)."""
    cost = dataclasses.replace(ZERO, step_fixed=1.0, train_fixed=5.0, kv_bytes_per_token=1.0,
                               host_bandwidth=0.5)
    assert _two_episodes(2, cost).metrics[0]["time"] == 21.0
    sim = _two_episodes(2, cost, host_kv=True)
    assert sim.metrics[0]["time"] == 27.0
    assert sim.stats["host_copies"] == 4


class Checked(ClusterSim):
    """Checks a slice's invariants each time it starts a chunk."""

    seen: dict = {}  # what the checks met, over every instance

    def _begin_chunk(self, sl):
        idle = sl.chunk is None
        super()._begin_chunk(sl)
        slots, cfg = self.config.slots_per_slice, self.config
        assert len(sl.where) == slots - len(sl.free) and int(sl.active.sum()) <= slots
        if cfg.episodes_per_slice:
            assert not sl.parked.any()  # released, never parked
            assert sl.num_held + len(sl.waiting) <= cfg.episodes_per_slice
            kept = sum(r.produced for r in [*sl.away.values(), *sl.ready] if r.kv_on_device)
            assert sl.away_kv == kept
        if idle and sl.chunk is not None:
            for what, met in (("chunks", True), ("kv_blocked", sl.kv_blocked),
                              ("away", sl.away), ("slots_full", not sl.free)):
                self.seen[what] = self.seen.get(what, 0) + bool(met)
            # No slot idles while an episode whose observation arrived, or a request
            # the KV memory takes, waits for one.
            assert not (sl.free and sl.ready)
            assert not (sl.free and sl.waiting and not sl.kv_blocked)


def _small(preset="multiturn_slow_release", tbs=16, slots=16, **kw):
    """The slow-tool preset at a CPU test's size: four slices of `slots` slots,
    groups of 4, four episodes a slot when it releases them."""
    p = dataclasses.replace(PRESETS[preset], train_batch_size=tbs,
                            rollout_batch_size=tbs * 3 // 2, group_size=4,
                            slots_per_slice=slots, **kw)
    if p.episodes_per_slice:
        p = dataclasses.replace(p, episodes_per_slice=4 * slots)
    return p


@pytest.mark.parametrize("mode,kv", [("sync", "device"), ("partial_rollout", "host"),
                                     ("partial_rollout", "device")])
def test_slice_invariants_at_every_chunk(mode, kv, monkeypatch):
    import dora_jax.sim.run as run
    monkeypatch.setattr(run, "ClusterSim", Checked)
    monkeypatch.setattr(Checked, "seen", {})
    preset = _small(episode_kv=kv)
    cost = dataclasses.replace(preset.cost(), kv_tokens=60_000)  # KV memory binds at times
    s = simulate(preset, mode, 3, cost=cost)
    assert s["audit_ok"], s["audit"]
    assert all(Checked.seen.get(k) for k in ("chunks", "kv_blocked", "away", "slots_full")), \
        Checked.seen
    assert s["slot_idle"]["env"] == 0 and (s["host_copies"] > 0) == (kv == "host")


@pytest.mark.parametrize("mode", SIM_MODES)
def test_every_mode_audits_clean_with_release(mode):
    for kv in ("device", "host"):
        s = simulate(_small(episode_kv=kv), mode, 3)
        assert s["audit_ok"], s["audit"]
        assert abs(sum(s["slot_idle"].values()) - 1.0) < 2e-3, s["slot_idle"]


def test_release_raises_throughput_with_slow_tools():
    """A batch of 256 episodes on 32 slots: held through their tool calls, the slots
    bound the rollout; released, four episodes a slot keep them decoding."""
    held = simulate(_small("multiturn_slow", tbs=64, slots=8), "dora", 4)
    released = simulate(_small(tbs=64, slots=8), "dora", 4)
    assert held["audit_ok"] and released["audit_ok"]
    assert released["tokens_per_second"] > 1.5 * held["tokens_per_second"]
    assert held["slot_idle"]["env"] > 0.3 and released["slot_idle"]["env"] == 0


def test_k_plus_1_adapter_versions_keep_dora_level_with_partial_rollout():
    """Slow tools, slots released, rollout-bound (48 trainer devices): a one-version
    slice idles on versions its episodes at their tools still hold; with adapters and
    K + 1 versions a slice none idles for a version, and dora, one version per
    episode, decodes as fast as partial rollout, which mixes them."""
    def run(mode, versions):
        p = _small("multiturn_slow_lora", tbs=64, versions_per_slice=versions,
                   trainer_devices=48)
        s = simulate(p, mode, 5)
        assert s["audit_ok"], s["audit"]
        return s
    one, multi, partial = run("dora", 1), run("dora", 4), run("partial_rollout", 1)
    assert one["slot_idle"]["version_mismatch"] > 0.1
    assert multi["slot_idle"]["version_mismatch"] == 0
    assert multi["tokens_per_second"] > 1.2 * one["tokens_per_second"]
    assert multi["tokens_per_second"] >= 0.99 * partial["tokens_per_second"]


def test_slow_tools_take_over_five_model_turns():
    """The slow preset's median tool call against a 400-token model turn at a full
    slice's decode step, every slot at the workload's mean position (the prompt and
    half a mean episode's response)."""
    preset = PRESETS["multiturn_slow"]
    w, cost, slots = preset.workload, preset.cost(), preset.slots_per_slice
    episode = w.episodes(preset.group_size)
    eps = [episode(g, k) for g in range(200) for k in range(preset.group_size)]
    position = w.prompt_len + sum(e.response_len for e in eps) / len(eps) / 2
    turn = w.mean_len * cost.step_seconds(slots, slots * position)
    assert w.turns.env_median >= 5 * turn and w.turns.env_sigma >= 1.0
    assert PRESETS["multiturn_slow_release"].episodes_per_slice == 4 * slots


def test_episode_knobs_are_checked():
    ok = PRESETS["multiturn_slow_release"]
    ok.check_episodes()
    for bad, word in [(dict(episodes_per_slice=100), "slots_per_slice"),
                      (dict(episodes_per_slice=0, episode_kv="host"), "needs episodes"),
                      (dict(episode_kv="disk"), "episode_kv")]:
        with pytest.raises(ValueError, match=word):
            dataclasses.replace(ok, **bad).check_episodes()
    with pytest.raises(ValueError, match="multi-turn"):
        dataclasses.replace(PRESETS["paper64"], episodes_per_slice=512).check_episodes()
    out = subprocess.run([sys.executable, "-m", "dora_jax.sim", "--preset=multiturn_slow",
                          "--episode_kv=host", "--steps=2"], capture_output=True, text=True)
    assert out.returncode != 0 and "--episodes_per_slice / --episode_kv" in out.stderr
