"""The paged KV cache under pressure, through a whole run (`experiment.run`): a page
pool far smaller than the slots' full contexts makes requests wait for pages and be
preempted, groups share their multi-page prompts, responses grow over several pages,
and the slices' free-KV reports bound what the scheduler gives them; the ledger still
audits clean and every trajectory the trainer receives is the dense cache's run's."""

import numpy as np
from conftest import audit_workdir

from dora_jax.rl.trainer import Trainer
from dora_jax.rollout.pages import PagePool
from dora_jax.rollout.slice import DecodeSlice
from dora_jax.runtime import experiment
from dora_jax.scheduler.core import Scheduler

PAGE_SIZE = 2
KV_PAGES = 12  # a full-length request (16 positions) needs 8; 4 slots would need 32
STEPS, GROUPS, GROUP_SIZE = 3, 6, 4


class TrajectoryTrainer(Trainer):
    """Records, per (group id, sample), what each trained sample is: the step, the
    response's first column (its prompt length), its tokens and behaviour log-probs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: dict = {}

    def train_step(self, batch):
        G = batch.group_size
        for row in range(batch.batch_size):
            on = batch.loss_mask_BT[row] != 0
            # Rows are group-contiguous, a group's samples in index order.
            key = (int(batch.group_ids[row // G]), row % G)
            assert key not in self.seen, key
            self.seen[key] = (self.version, int(np.flatnonzero(on)[0]),
                              batch.tokens_BT[row][on].tolist(),
                              np.asarray(batch.behaviour_logp_BT[row][on], np.float64))
        return super().train_step(batch)


def _run(cfg, workdir):
    made = []

    def make_trainer(*args, **kwargs):
        made.append(TrajectoryTrainer(*args, **kwargs))
        return made[0]

    experiment.run(cfg, str(workdir), make_trainer=make_trainer)
    _, report = audit_workdir(cfg, workdir)
    assert report.ok and report.steps == STEPS, report.summary()
    return made[0].seen


def test_paged_run_under_pressure_equals_dense_run(tmp_path, small_config, monkeypatch):
    """A sync run whose slices each have a pool of 12 pages of 2 positions (their 4
    slots of 16 positions would need 32): 6-token prompts span 3 pages, which a
    group's later samples map instead of prefilling, 8-token responses grow over 4
    more, so requests wait for pages and are preempted (and resumed by re-prefill),
    and the slices' free-KV reports hold back the scheduler's assignments. The
    ledger audits clean, and each trajectory trained has the response tokens of the
    same run on the dense cache exactly, and its behaviour log-probs to float32
    rounding: the paged path changes where KV lives and when a request runs, never
    what it samples (sampling is seeded per request; sync's params depend only on
    the batches trained)."""
    # 6 groups of 4 per step: 24 samples for 16 slots, so samples wait while others
    # run, and the free-KV reports decide how many more a slice takes.
    kwargs = dict(group_size=GROUP_SIZE, train_batch_size=GROUPS, rollout_batch_size=GROUPS,
                  num_steps=STEPS)
    paged_cfg = small_config("sync", rollout=dict(page_size=PAGE_SIZE, kv_pages=KV_PAGES),
                             **kwargs)
    dense_cfg = small_config("sync", rollout=dict(kv_cache="dense"), **kwargs)
    assert paged_cfg.rollout.kv_cache == "paged"

    # Instruments: the run's slices, what their pools hand out, what the scheduler hears.
    slices, shared_maps, slot_pages, reports = [], [], [], []
    create = DecodeSlice.create.__func__
    assign, advance, kv_reported = PagePool.assign, PagePool.advance, Scheduler.kv_reported

    def recording_create(cls, *args, **kwargs):
        slices.append(create(cls, *args, **kwargs))
        return slices[-1]

    def recording_assign(self, slot, tokens, shared=()):
        shared_maps.append(len(shared))
        return assign(self, slot, tokens, shared)

    def recording_advance(self, n):
        advance(self, n)
        slot_pages.append(int(self.mapped.max()))

    def recording_kv_reported(self, slice_id, free_tokens):
        kv_reported(self, slice_id, free_tokens)
        sl = self.slices[slice_id]
        # Kept (the slice still runs samples), and whether it now gives the slice
        # fewer samples than its free slots.
        binds = (sl.kv_free is not None
                 and self.free_slots(sl) < self.config.slots_per_slice - len(sl.running))
        reports.append((free_tokens, sl.kv_free is not None, binds))

    monkeypatch.setattr(DecodeSlice, "create", classmethod(recording_create))
    monkeypatch.setattr(PagePool, "assign", recording_assign)
    monkeypatch.setattr(PagePool, "advance", recording_advance)
    monkeypatch.setattr(Scheduler, "kv_reported", recording_kv_reported)
    paged = _run(paged_cfg, tmp_path / "paged")
    monkeypatch.undo()  # the dense run is the plain one
    dense = _run(dense_cfg, tmp_path / "dense")

    # Every path ran, by the run's own counters.
    stats = [sl.stats for sl in slices]
    counters = dict(preempted=sum(s.preempted for s in stats),
                    prefills=sum(s.prefills for s in stats),
                    shared_starts=sum(s.prefills_shared for s in stats),
                    peak_pages=[s.peak_pages for s in stats],
                    most_slot_pages=max(slot_pages),
                    kv_reports=(len(reports), sum(k for _, k, _ in reports),
                                sum(b for *_, b in reports)))
    samples = STEPS * GROUPS * GROUP_SIZE
    assert len(paged) == samples, len(paged)
    assert counters["preempted"] > 0, counters
    assert all(0 < p <= KV_PAGES for p in counters["peak_pages"]), counters
    for sl in slices:  # every page came back, none lost or doubly held
        sl.engine.pages.check()
        assert sl.engine.pages.num_used == 0
    # Prompts span whole pages, which the group's other samples map: prompts are
    # prefilled far fewer times than samples start.
    prompt_len = {start for _, start, _, _ in paged.values()}
    assert prompt_len == {6}, prompt_len
    assert max(shared_maps) == 6 // PAGE_SIZE, shared_maps
    assert counters["prefills"] < samples and counters["shared_starts"] > 0, counters
    # Responses grow over the pool's pages: a slot reaches 3 pages past its prompt.
    assert counters["most_slot_pages"] >= 6 // PAGE_SIZE + 3, counters
    # The free-KV reports reached the scheduler, and bounded its assignments.
    assert [f for f, kept, _ in reports if kept and f < KV_PAGES * PAGE_SIZE], reports
    assert any(b for *_, b in reports), reports

    # Trajectory by trajectory, the dense run's: same steps, prompts and tokens.
    assert paged.keys() == dense.keys()
    for key, (step, start, tokens, _) in dense.items():
        assert paged[key][:3] == (step, start, tokens), (key, paged[key][:3], tokens)
    # Step 0 samples under the same (initial) params in both runs: the log-probs
    # differ only by the float32 rounding of paged vs dense attention (and of a
    # preempted request's re-prefill): about 1 ulp.
    for key, (step, _, _, logp) in dense.items():
        if step == 0:
            np.testing.assert_allclose(paged[key][3], logp, rtol=0, atol=1e-5,
                                       err_msg=str(key))
    # Later steps sample under params trained on those log-probs: Adam's first
    # update, lr * g / (|g| + eps), turns a 1-ulp change of the behaviour log-probs
    # into up to ~1e-4 of the params where a gradient entry cancels to a few eps,
    # so the runs' params, and the log-probs sampled under them, agree only to a
    # few parts in a million (not to an absolute 1e-5 at |log p| ~ 5).
    for key, (step, _, _, logp) in dense.items():
        np.testing.assert_allclose(paged[key][3], logp, rtol=1e-5, atol=1e-5,
                                   err_msg=str(key))
