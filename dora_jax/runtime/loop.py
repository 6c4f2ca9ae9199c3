"""The run loop: drives real decode slices and the trainer from the scheduling core.

Every decode slice runs its own loop (`worker.SliceWorker`, a thread owning the
slice's engine and decode state); the trainer runs in its own thread, fed through
the Grain trajectory stream; rewards are computed on host threads as samples
finish. The coordinator (this module, the caller's thread) alone owns the
`Scheduler`: it waits for events (samples finished, version loaded, step done,
failure), feeds them to the scheduler, and sends the actions `decide()` returns as
commands. It never waits on a slice's device work, and one slice loading weights or
taking a migration never pauses another.

Weights: after step t the trainer thread dispatches a copy of the params (version
t+1) on the trainer mesh — the next step donates the originals — without waiting for
it; for a slice told to load that version the coordinator dispatches the
`jax.device_put` to the slice's shardings (asynchronous; one thread issues every
transfer of the same arrays) and the slice's own loop waits for its copy only, while
the other slices decode. Only the newest version's params are
kept here (slices only ever load the newest; a pending load holds its own
reference). A slice told to load the version still in training
(partial_rollout_rounds) gets a future instead, which `_on_step_done` fills with its
placed params on publication: that slice's loop pauses on it, nothing else does.
The README's "Life of a group" names the function at each hop.

A failure anywhere (a slice, the trainer, the coordinator) stops the run with one
`RunError` naming where it happened, after the ledger has recorded an `unconsumed`
line for every admitted group not consumed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import threading
import time
from typing import Callable

import jax
import numpy as np

from dora_jax.data.prompts import PromptStream
from dora_jax.runtime.reward_pool import RewardPool
from dora_jax.model.sharding import copy_tree
from dora_jax.rollout.trajectory import Request
from dora_jax.runtime import restart, scoring
from dora_jax.runtime.report import StepReporter, WaitClock
from dora_jax.runtime.stream import GroupQueue, train_batches
from dora_jax.runtime.worker import Event, SliceWorker
from dora_jax.scheduler.core import Scheduler
from dora_jax.scheduler.ledger import LedgerWriter
from dora_jax.scheduler.types import (Admit, Assign, InterruptReload, LoadVersion, Migrate,
                                      TrainStep)
from dora_jax.timeline import Timeline


class RunError(RuntimeError):
    """The run stopped: a slice, the trainer or the coordinator failed (the cause is
    chained). The ledger accounts for every admitted group."""


def request_seed(run_seed: int, group_id: int, sample: int) -> np.ndarray:
    """Per-request RNG key data: a function of (run seed, group, sample) only, so a
    sample does not depend on which slot or slice generates it."""
    return np.random.SeedSequence([run_seed, group_id, sample]).generate_state(2)


@dataclasses.dataclass
class _Group:
    record: dict
    version: int
    trajectories: dict = dataclasses.field(default_factory=dict)  # sample -> Trajectory
    rewards: dict = dataclasses.field(default_factory=dict)  # sample -> Future


class Runtime:
    """Runs `num_steps` train steps of one mode end to end.

    Args:
      cfg: validated `Config`.
      scheduler: a fresh `Scheduler` for `cfg.coordinator`.
      slices: `DecodeSlice`s on disjoint sub-meshes, ids 0..S-1, holding version 0.
      trainer: an `rl.trainer.Trainer` on the trainer mesh.
      prompts: the prompt stream (Grain).
      rewards: the host reward pool.
      ledger: where admit/consume/unconsumed events go.
      reporter: per-step metrics (metrics.jsonl) and the run summary.
      timeline: decode, load, migration and train spans.
      on_step: called with each step's metrics record (progress bar).
      checkpointer: if given, `save_checkpoint` is called every
        `coordinator.checkpoint_every` steps.
      resumed: the run this one continues (`restart.load`): its finished groups are
        restored, its lost ones admitted again, and the ledger says so.
    """

    def __init__(self, cfg, scheduler: Scheduler, slices, trainer, prompts: PromptStream,
                 rewards: RewardPool, ledger: LedgerWriter, reporter: StepReporter,
                 timeline: Timeline, on_step: Callable[[dict], None] = lambda m: None,
                 checkpointer=None, clock: Callable[[], float] = time.perf_counter,
                 resumed=None):
        self.cfg, self.sched, self.slices, self.trainer = cfg, scheduler, slices, trainer
        self.prompts, self.rewards, self.ledger = prompts, rewards, ledger
        self.reporter, self.timeline, self.on_step = reporter, timeline, on_step
        self.checkpointer = checkpointer
        self._saved_version = None
        self._t0 = clock()
        self.clock = lambda: clock() - self._t0
        self.groups: dict[int, _Group] = {}
        # Params of the newest published version. A copy: the first step donates the
        # trainer's own buffers.
        self.params_by_version = {trainer.version: copy_tree(trainer.params)}
        self._readmit: dict = {}
        # Version in training -> [(slice id, worker, future)]: loads awaiting its publish.
        self._deferred_loads: dict = {}
        if resumed is not None:
            self._restore(resumed)
        self._events: queue.Queue = queue.Queue()
        c = cfg.coordinator
        self.workers = [SliceWorker(sl, self._events, timeline, self.clock,
                                    fail_at_version=c.fail_slice_at if sl.slice_id == c.fail_slice
                                    else None) for sl in slices]
        self.slice_failures: list = []  # (slice id, step) of each failure survived
        self._reported = 0  # of them, in metrics.jsonl so far
        self._stream = GroupQueue()
        self._inflight_batches: dict[int, tuple] = {}
        self._to_ack: set = set()  # slices whose finished samples await an answer
        self._scoring: set = set()  # finished groups whose rewards are not all in
        self.max_resident_versions = 1
        self._trainer_idle_since = 0.0
        self.waits = WaitClock()
        self._trainer_thread = threading.Thread(target=self._train_loop, name="trainer",
                                                daemon=True)

    # ------------------------------------------------------------------ trainer
    def _train_loop(self):
        c = self.cfg
        stream = train_batches(self._stream, group_size=c.coordinator.group_size,
                               num_groups=c.coordinator.train_batch_size,
                               length_buckets=c.trainer.length_buckets,
                               pad_id=c.rollout.pad_id)
        try:
            for step, batch in stream:
                start = self.clock()
                metrics = self.trainer.train_step(batch)
                # Publish: a copy, as the next step donates the trainer's params. Its
                # dispatch is asynchronous; slices wait for it, the trainer does not.
                params = copy_tree(self.trainer.params)
                metrics = jax.device_get(metrics)  # the step's only host sync
                end = self.clock()
                self.timeline.add("trainer", "train", start, end, step)
                self._events.put(Event("step", "trainer",
                                       (step, batch, metrics, params, start, end)))
        except BaseException as e:  # noqa: BLE001 - surfaced by the coordinator
            self._events.put(Event("failed", "trainer", e))

    def _on_step_done(self, item):
        step, batch, metrics, params, start, end = item
        self.sched.step_finished(step)
        # Params of the new version, and of every version a slice holds or loads
        # (dora may load an older one onto a freed slice).
        held = {v for sl in self.sched.slices for v in (sl.version, sl.loading)}
        # and of every version with samples to (re)generate (a failed slice's).
        held |= {g.version for g in self.sched.groups.values() if g.n_pending}
        self.params_by_version = {v: x for v, x in self.params_by_version.items() if v in held}
        self.params_by_version[step + 1] = params
        for i, worker, box in self._deferred_loads.pop(step + 1, []):
            if self.workers[i] is worker:  # not a slice that failed and restarted since
                box.set_result(self.slices[i].engine.load_params(params))
        self._trainer_idle_since = end
        self.waits.mark(end, self._wait_kind())
        group_ids, wait, wait_split = self._inflight_batches.pop(step)
        for gid in group_ids:
            g = self.groups.pop(gid)
            self.ledger.write("consume", group_id=gid, prompt_id=g.record["prompt_id"],
                              version=g.version, step=step, time=end,
                              samples=self._sample_entries(g))
        record = self.reporter.step(step, batch, metrics, wait=wait, wait_split=wait_split,
                                    train_time=end - start, now=end, slices=self.slices,
                                    scheduler=self.sched,
                                    slice_failures=len(self.slice_failures) - self._reported)
        self._reported = len(self.slice_failures)
        every = self.cfg.coordinator.checkpoint_every
        if self.checkpointer is not None and every and (step + 1) % every == 0:
            self.save_checkpoint()
        self.on_step(record)

    def _restore(self, resumed):
        """Takes over a resumed run's finished groups and lost prompts, and writes
        the ledger's `resume` line (scheduler/ledger.py says what it voids)."""
        for gid, saved in resumed.kept.items():
            g = self.groups[gid] = _Group(saved["record"], saved["version"])
            for t, (reward, error) in zip(restart.trajectories(saved), saved["rewards"]):
                g.trajectories[t.sample_index] = t
                g.rewards[t.sample_index] = done = concurrent.futures.Future()
                done.set_result((reward, error))
        self._readmit = dict(resumed.readmit_records)
        self._saved_version = self.trainer.version
        # What the crash left damaged, and was repaired or passed over on the way here.
        damage = {k: v for k, v in (("repaired", self.ledger.repaired),
                                    ("skipped_checkpoints", resumed.skipped_checkpoints)) if v}
        self.ledger.write("resume", step=self.trainer.version, time=self.clock(),
                          kept=len(resumed.kept), readmitted=len(self._readmit), **damage)

    def save_checkpoint(self) -> None:
        """Saves the train state with everything the coordinator knows (scheduler
        snapshot, prompt-stream state, the prompt of every unconsumed group).

        Called between steps from the coordinator thread: the trainer is idle (it
        only gets a batch from `decide()`), so its state is not being donated."""
        if self.trainer.version == self._saved_version:
            return
        self._saved_version = self.trainer.version
        finished = {str(gid): restart.finished_group(g, [list(g.rewards[k].result())
                                                         for k in sorted(g.trajectories)])
                    for gid, g in self.groups.items() if self.sched.groups[gid].trainable}
        self.ledger.sync()  # the ledger lines this checkpoint relies on reach disk first
        self.checkpointer.save(self.trainer.version, self.trainer.state, {
            "scheduler": self.sched.snapshot(),
            "prompt_stream": self.prompts.get_state(),
            "finished_groups": finished,
        }, force=True)

    def _sample_entries(self, g: _Group) -> list:
        """The `samples` of a group's `consume` line, in sample order."""
        entries = []
        for k, penalty in zip(sorted(g.trajectories), scoring.penalties(self.cfg, g)):
            t = g.trajectories[k]
            reward, error = g.rewards[k].result()
            entry = {"sample": k, "versions": t.versions, "slices": t.slice_ids,
                     "response_len": len(t.response_tokens), "finish": t.finish_reason,
                     "reward": reward}
            if penalty:
                entry["overlong_penalty"] = penalty
            if error:
                entry["reward_error"] = error
            entries.append(entry)
        return entries

    # ------------------------------------------------------------------ actions
    def _execute(self, actions):
        for a in actions:
            if isinstance(a, Admit):
                self._admit(a)
            elif isinstance(a, Assign):
                g = self.groups[a.group_id]
                self.workers[a.slice_id].submit(Request(
                    group_id=a.group_id, prompt_id=g.record["prompt_id"], sample_index=a.sample,
                    prompt_tokens=g.record["tokens"], version=a.version,
                    group_version=g.version,
                    seed=request_seed(self.cfg.seed, a.group_id, a.sample)))
            elif isinstance(a, Migrate):
                self.workers[a.src_slice].migrate([(a.group_id, a.sample)],
                                                  self.workers[a.dst_slice])
            elif isinstance(a, (LoadVersion, InterruptReload)):
                params = self.params_by_version.get(a.version)
                if params is None and self.sched.trainer_busy and \
                        a.version == self.sched.published + 1:
                    # The version in training: placed when published (_on_step_done).
                    box = concurrent.futures.Future()
                    self._deferred_loads.setdefault(a.version, []).append(
                        (a.slice_id, self.workers[a.slice_id], box))
                    self.workers[a.slice_id].load(a.version, box,
                                                  interrupt=isinstance(a, InterruptReload))
                    continue
                if params is None:
                    raise RuntimeError(f"version {a.version} is not published "
                                       f"(have {list(self.params_by_version)})")
                # The transfer is dispatched here, one thread for every device_put of
                # the same params; the slice's own loop waits for its copy only.
                placed = self.slices[a.slice_id].engine.load_params(params)
                self.workers[a.slice_id].load(a.version, placed,
                                              interrupt=isinstance(a, InterruptReload))
            elif isinstance(a, TrainStep):
                self._train(a)
            else:  # pragma: no cover - the core emits only the types above
                raise TypeError(f"unknown action {a!r}")

    def _admit(self, a: Admit):
        record = self._readmit.pop(a.group_id) if a.readmit else self.prompts.next()
        if record is None:
            raise RuntimeError(f"prompt source exhausted at group {a.group_id}")
        self.groups[a.group_id] = _Group(record, a.version)
        self.ledger.write("admit", group_id=a.group_id, prompt_id=record["prompt_id"],
                          version=a.version, time=self.clock(),
                          **({"readmit": True} if a.readmit else {}))

    def _train(self, a: TrainStep):
        """Form the batch: the step's groups, scored, go into the trajectory stream."""
        trajectories = []
        for gid in a.group_ids:
            g = self.groups[gid]
            for k, reward in zip(sorted(g.trajectories), scoring.shaped_rewards(self.cfg, g)):
                g.trajectories[k].reward = reward
                trajectories.append(g.trajectories[k])
        now = self.clock()
        self._inflight_batches[a.step] = (a.group_ids, now - self._trainer_idle_since,
                                          self.waits.take(now))
        self._stream.put(a.step, trajectories)

    # ------------------------------------------------------------------ events
    def _handle(self, ev: Event) -> int:
        """Feeds one event to the scheduler; returns the train steps it completed."""
        if ev.kind == "finished":
            self._to_ack.add(ev.source)
            for t in ev.data:
                g = self.groups[t.group_id]
                g.trajectories[t.sample_index] = t
                g.rewards[t.sample_index] = self.rewards.submit(g.record, t.response_tokens)
                self.sched.sample_finished(t.group_id, t.sample_index, len(t.response_tokens))
                if self.sched.config.score_groups and self.sched.groups[t.group_id].finished:
                    self._score_when_ready(t.group_id)
            if ev.kv_free is not None:
                self.sched.kv_reported(ev.source, ev.kv_free)
        elif ev.kind == "scored":
            self._scored(ev.data)
        elif ev.kind == "loaded":
            self.sched.version_loaded(ev.source, ev.data)
        elif ev.kind == "step":
            self._on_step_done(ev.data)
            return 1
        elif ev.kind == "failed" and ev.source != "trainer" and (
                len(self.slice_failures) < self.cfg.coordinator.max_slice_restarts):
            self._restart_slice(ev.source, ev.data)
        elif ev.kind == "failed":
            trainer = ev.source == "trainer"
            step = self.sched.trainer_step if trainer and self.sched.trainer_busy \
                else self.sched.next_step
            raise RunError(f"{'the trainer' if trainer else f'slice {ev.source}'} failed at "
                           f"step {step}: {type(ev.data).__name__}: {ev.data}") from ev.data
        return 0

    def _restart_slice(self, i: int, error: BaseException):
        """A slice raised: what it held is lost. Its running samples are regenerated
        under their groups' versions (C1), migrations out of it that never left are
        regenerated too, and a fresh loop starts on the emptied slice, which the
        scheduler then tells which version to load. The ledger and metrics.jsonl
        record it."""
        dead = self.workers[i]
        lost = 0
        for box, request_ids, dst in list(dead.unfilled.values()):
            box.put([])  # its destination waits for the hand-over: nothing comes
            for gid, k in request_ids:
                g = self.sched.groups.get(gid)
                smp = None if g is None else g.samples[k]
                if smp is not None and smp.status == "running" and smp.slice_id == dst.slice_id:
                    self.sched.sample_lost(gid, k)
                    lost += 1
        lost += len(self.sched.slices[i].running)
        self.sched.slice_failed(i)
        self.slices[i].abandon()
        self._to_ack.discard(i)
        self.slice_failures.append((i, self.sched.next_step))
        self.ledger.write("slice_failed", slice=i, step=self.sched.next_step,
                          time=self.clock(), error=f"{type(error).__name__}: {error}",
                          regenerated=lost)
        self.workers[i] = SliceWorker(self.slices[i], self._events, self.timeline, self.clock)
        self.workers[i].start()

    def _score_when_ready(self, gid: int):
        """Posts a "scored" event once every reward of the finished group is in (a
        reward pool thread runs the last callback; the coordinator never waits)."""
        self._scoring.add(gid)
        scoring.when_all_done(list(self.groups[gid].rewards.values()),
                              lambda: self._events.put(Event("scored", "rewards", gid)))

    def _scored(self, gid: int):
        """DAPO's dynamic sampling: a group whose rewards are all equal carries no
        learning signal (every advantage is 0); it leaves with a `filter` record and
        the scheduler admits another in its place."""
        self._scoring.discard(gid)
        g = self.groups[gid]
        rewards = scoring.shaped_rewards(self.cfg, g)
        keep = max(rewards) != min(rewards)
        self.sched.group_scored(gid, keep)
        if not keep:
            del self.groups[gid]
            self.ledger.write("filter", group_id=gid, prompt_id=g.record["prompt_id"],
                              version=g.version, time=self.clock(),
                              reason="zero reward variance", reward=rewards[0])

    def _wait_kind(self) -> str | None:
        """Why the trainer is idle now (`report.WaitClock`), or None if it is busy."""
        if self.sched.trainer_busy:
            return None
        if self.sched.next_step == 0:
            return "fill"
        finished = self.sched.num_finished_groups
        return "guard" if finished >= self.cfg.coordinator.train_batch_size else "starvation"

    def _work_in_flight(self) -> bool:
        """Something will post an event: a sample running, a load, or a train step."""
        return (self.sched.trainer_busy or bool(self._scoring)
                or any(sl.running or sl.loading is not None for sl in self.sched.slices))

    # ------------------------------------------------------------------ loop
    def run(self, num_steps: int) -> dict:
        """Runs until `num_steps` train steps finished; returns the run summary.

        Raises RunError (after writing `unconsumed` lines for every group in flight)
        if any part fails."""
        for w in self.workers:
            w.start()
        self._trainer_thread.start()
        steps_done = 0
        try:
            self.waits.mark(self._trainer_idle_since, self._wait_kind())
            self._execute(self.sched.decide())
            self.waits.mark(self.clock(), self._wait_kind())
            while steps_done < num_steps:
                if not self._work_in_flight():
                    raise RuntimeError("no slice holds work, none is loading and the "
                                       "trainer is idle: the run cannot progress; scheduler "
                                       f"state: {self.sched.snapshot()}")
                steps_done += self._handle(self._events.get())
                while steps_done < num_steps:  # take every event already posted
                    try:
                        steps_done += self._handle(self._events.get_nowait())
                    except queue.Empty:
                        break
                if steps_done < num_steps:
                    self._execute(self.sched.decide())
                    self.waits.mark(self.clock(), self._wait_kind())
                    resident = {sl.effective_version for sl in self.sched.slices} - {None}
                    self.max_resident_versions = max(self.max_resident_versions,
                                                     len(resident))
                    for i in self._to_ack:
                        self.workers[i].ack()
                    self._to_ack.clear()
        except BaseException as e:
            self._finish()
            if isinstance(e, RunError):
                raise
            raise RunError(f"the coordinator failed at step {self.sched.next_step}: "
                           f"{type(e).__name__}: {e}") from e
        self._finish()
        summary = self.reporter.summary(self.slices, self.timeline)
        summary["max_resident_versions"] = self.max_resident_versions
        summary["groups_filtered"] = self.sched.filtered
        summary["slice_failures"] = len(self.slice_failures)
        # Forward passes over prompts (re-prefills included) per admitted group.
        summary["prefills_per_group"] = round(sum(sl.stats.prefills for sl in self.slices)
                                              / max(self.sched.next_group_id, 1), 3)
        return summary

    def _finish(self):
        """The ledger's final lines, then the threads stopped even if writing them
        fails (a full disk): the caller still closes the checkpointer."""
        try:
            self._write_unconsumed()
        finally:
            self._shutdown()

    def _write_unconsumed(self):
        for gid, g in sorted(self.groups.items()):
            self.ledger.write("unconsumed", group_id=gid, version=g.version)
        for gid in self.sched.readmit_queue:  # lost in a crash, not admitted again yet
            self.ledger.write("unconsumed", group_id=gid, version=None)

    def _shutdown(self):
        self._stream.close()
        for w in self.workers:
            w.stop()
        self._trainer_thread.join(timeout=600)
