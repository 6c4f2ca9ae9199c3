"""The run loop: real decode slices and the trainer, driven by the scheduling core.

Each slice runs in its own thread (`worker.SliceWorker`), the trainer in another
(`trainer_worker.TrainerWorker`, fed through the Grain trajectory stream), rewards in
the reward pool's processes. The coordinator (the caller's thread) alone owns the
`Scheduler`: it feeds it typed events (events.py) and carries out the actions
`decide()` returns (`Driver.execute`); it never waits on device work. "Life of a
group" in docs/modes.md names the function at each hop.

A failure anywhere stops the run with one `RunError` naming where, after the ledger
records every admitted group not consumed; a slice's failure is survived (the slice
restarts) up to `coordinator.max_slice_restarts` times.
"""

from __future__ import annotations

import functools
import queue
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from dora_jax.base.timeline import Timeline
from dora_jax.data.prompts import PromptStream
from dora_jax.rewards.pool import RewardPool
from dora_jax.rollout.sampling import request_seed
from dora_jax.rollout.trajectory import Request
from dora_jax.runtime.evaluation import Evaluation
from dora_jax.runtime.events import (
    TRAINER,
    EvalGenerated,
    EvalScored,
    Failed,
    GroupScored,
    SamplesFinished,
    StepDone,
    VersionLoaded,
)
from dora_jax.runtime.faults import NO_FAULTS, Faults
from dora_jax.runtime.groups import GroupBook
from dora_jax.runtime.report import StepReporter, WaitClock, episode_record
from dora_jax.runtime.saves import BackgroundSaves, SaveCadence
from dora_jax.runtime.trainer_worker import SentBatch, TrainerWorker
from dora_jax.runtime.weights import WeightBook
from dora_jax.runtime.worker import SliceWorker
from dora_jax.scheduler.core import Scheduler
from dora_jax.scheduler.driver import Driver
from dora_jax.scheduler.ledger import LedgerWriter
from dora_jax.scheduler.types import Admit, Assign, Migrate, TrainStep

if TYPE_CHECKING:
    from flax import nnx

    from dora_jax.config import Config
    from dora_jax.model.checkpointing import Checkpointer
    from dora_jax.rl.trainer import Trainer
    from dora_jax.rollout.slice import DecodeSlice
    from dora_jax.runtime.evaluation import EvalDecoder
    from dora_jax.runtime.events import Event
    from dora_jax.runtime.recovery import Resumed
    from dora_jax.scheduler.types import AddVersion, Evict, InterruptReload, LoadVersion


class RunError(RuntimeError):
    """The run stopped: a slice, the trainer or the coordinator failed (the cause is
    chained). The ledger accounts for every admitted group."""


class Runtime(Driver):
    """Runs `num_steps` train steps of one mode end to end.

    `slices` are `DecodeSlice`s on disjoint sub-meshes holding the trainer's version;
    `checkpointer` (optional) saves every `coordinator.checkpoint_every` steps, at most
    once per `coordinator.checkpoint_min_seconds`, off this thread (saves.py);
    `resumed` (`recovery.load`) is the run this one continues;
    `eval_decoder` evaluates `eval_prompts` every `eval.every` steps (evaluation.py);
    `faults` is where drills fail the run on purpose (faults.py; none by default);
    `make_worker(slice, events, timeline, clock, faults)` runs a slice (a
    `SliceWorker`, or a slice process's `remote.RemoteSliceWorker`).
    """

    def __init__(self, cfg: Config, scheduler: Scheduler, slices: list[DecodeSlice],
                 trainer: Trainer, prompts: PromptStream, rewards: RewardPool, ledger: LedgerWriter,
                 reporter: StepReporter, timeline: Timeline,
                 on_step: Callable[[dict], None] = lambda m: None,
                 checkpointer: Checkpointer | None = None,
                 clock: Callable[[], float] = time.perf_counter, resumed: Resumed | None = None,
                 eval_decoder: EvalDecoder | None = None,
                 eval_prompts: Sequence[dict] = (), faults: Faults = NO_FAULTS,
                 make_worker: Callable[..., Any] = SliceWorker) -> None:
        self.cfg, self.sched, self.slices, self.trainer = cfg, scheduler, slices, trainer
        self.prompts, self.ledger = prompts, ledger
        self.reporter, self.timeline, self.on_step = reporter, timeline, on_step
        self._saved_version: int | None = None
        self._t0 = clock()
        self.clock = lambda: clock() - self._t0
        self.book = GroupBook(cfg, rewards, ledger.write, self.clock)
        # A copy: the first step donates the trainer's own buffers. LoRA publishes
        # only the adapters.
        self.weights = WeightBook(trainer.version, trainer.published_params(),
                                  adapters_only=cfg.model.lora.enabled)
        self._readmit: dict = {}
        if resumed is not None:
            self._restore(resumed)
        self._events: queue.Queue = queue.Queue()
        self.evaluation = None if eval_decoder is None else Evaluation(
            cfg.eval, eval_prompts, eval_decoder, rewards, self._events, self.clock)
        self.faults = faults
        # A slice in another process gets remote.RemoteSliceWorker.
        self._make_worker = make_worker
        self.workers = [make_worker(sl, self._events, timeline, self.clock, faults)
                        for sl in slices]
        self._saves = None if checkpointer is None else BackgroundSaves(
            checkpointer, after_copy=lambda: faults.run_reached("save"))
        c = cfg.coordinator
        self._cadence = SaveCadence(c.checkpoint_every, c.checkpoint_min_seconds, self.clock())
        self.slice_failures: list = []  # (slice id, step) of each failure survived
        self._reported = 0  # of them, in metrics.jsonl so far
        self.trainer_worker = TrainerWorker(trainer, cfg, self._events, timeline, self.clock,
                                            saves=self._saves, faults=faults)
        self._inflight_batches: dict[int, SentBatch] = {}
        self._to_ack: set = set()  # slices whose finished samples await an answer
        self._scoring: set = set()  # finished groups whose rewards are not all in
        self.max_resident_versions = 1
        self._trainer_idle_since = 0.0
        self.waits = WaitClock()
        self._stalled = False  # a stalled part is not waited for at exit

    # ------------------------------------------------------------------ trainer
    def _step_done(self, ev: StepDone) -> None:
        step = ev.step
        self.sched.step_finished(step)
        # Keep the params of every version a slice holds or loads (dora may load an
        # older one onto a freed slice) or that has samples to (re)generate.
        keep = {v for sl in self.sched.slices
                for v in (sl.version, sl.loading, *sl.held, *sl.adding)}
        keep |= {g.version for g in self.sched.groups.values() if g.n_pending}
        self.weights.publish(step + 1, ev.params, keep)
        self._evaluate(step + 1, self.weights.for_load(step + 1))
        self._trainer_idle_since = ev.end
        self.waits.mark(ev.end, self._wait_kind())
        sent = self._inflight_batches.pop(step)
        self.book.consume(sent.group_ids, step, ev.end)
        pause = 0.0
        if self._saves is not None and self._cadence.due(step + 1, self.clock()):
            start = self.clock()
            self.save_checkpoint()
            pause = self.clock() - start
        record = self.reporter.step(step, ev.batch, ev.metrics, wait=sent.wait,
                                    wait_split=sent.wait_split, train_time=ev.end - ev.start,
                                    now=ev.end, slices=self.slices, scheduler=self.sched,
                                    slice_failures=len(self.slice_failures) - self._reported,
                                    checkpoint_pause=pause,
                                    checkpoint_copy_wait=ev.copy_wait,
                                    episodes=sent.episodes,
                                    publish_bytes=self.weights.publish_bytes)
        self._reported = len(self.slice_failures)
        self.on_step(record)

    def _evaluate(self, version: int, params: nnx.State, *, last: bool = False) -> int:
        if self.evaluation is not None:
            self.evaluation.offer(self.workers[self.cfg.eval.slice], version, params,
                                  last=last)
        return version

    def _restore(self, resumed: Resumed) -> None:
        """Takes over a resumed run's finished groups and lost prompts, and writes
        the ledger's `resume` line (scheduler/ledger.py says what it voids)."""
        self.book.restore(resumed.kept)
        self._readmit = dict(resumed.readmit_records)
        self._saved_version = self.trainer.version
        # What the crash left damaged, and was repaired or passed over on the way here.
        damage = {k: v for k, v in (("repaired", self.ledger.repaired),
                                    ("skipped_checkpoints", resumed.skipped_checkpoints)) if v}
        self.ledger.write("resume", step=self.trainer.version, time=self.clock(),
                          kept=len(resumed.kept), readmitted=len(self._readmit), **damage)

    def save_checkpoint(self) -> None:
        """Saves the train state and what a resume needs beside the ledger. Called
        between steps, with the trainer idle; its next step waits only for the
        state's copy to the host (saves.py)."""
        if self._saves is None or self.trainer.version == self._saved_version:
            return
        self._saved_version = self.trainer.version
        self._cadence.saved(self.clock())
        trainable = [gid for gid in self.book.groups if self.sched.groups[gid].trainable]
        self.ledger.sync()  # the ledger lines this checkpoint relies on reach disk first
        self._saves.submit(self.trainer.version, self.trainer.state, {
            "scheduler": {"next_group_id": self.sched.next_group_id},
            "prompt_stream": self.prompts.get_state(),
            "finished_groups": self.book.checkpoint_form(trainable),
        })

    def close_saves(self) -> None:
        """Waits for the saves handed over to be under way; raises one that failed."""
        if self._saves is not None:
            self._saves.close()

    # ------------------------------------------------------------------ actions
    def admit(self, a: Admit) -> None:
        record = self._readmit.pop(a.group_id) if a.readmit else self.prompts.next()
        if record is None:
            raise RuntimeError(f"prompt source exhausted at group {a.group_id}")
        self.book.admit(a, record)

    def assign(self, a: Assign) -> None:
        g = self.book[a.group_id]
        self.workers[a.slice_id].submit(Request(
            group_id=a.group_id, prompt_id=g.record["prompt_id"], sample_index=a.sample,
            prompt_tokens=g.record["tokens"], version=a.version, group_version=g.version,
            seed=request_seed(self.cfg.seed, a.group_id, a.sample),
            record=g.record if self.cfg.data.source == "env" else None))

    def migrate(self, a: Migrate) -> None:
        self.workers[a.src_slice].migrate([(a.group_id, a.sample)], self.workers[a.dst_slice])

    def load(self, a: LoadVersion | InterruptReload, *, interrupt: bool) -> None:
        in_training = self.sched.published + 1 if self.sched.trainer_busy else None
        self.workers[a.slice_id].load(a.version, self.weights.for_load(a.version, in_training),
                                      interrupt=interrupt)

    def add_version(self, a: AddVersion) -> None:
        self.workers[a.slice_id].add(a.version, self.weights.for_load(a.version))

    def evict(self, a: Evict) -> None:
        self.workers[a.slice_id].evict(a.version)

    def train(self, a: TrainStep) -> None:
        """The step's groups, scored, go into the trajectory stream."""
        trajectories = self.book.batch(a.group_ids)
        now = self.clock()
        self._inflight_batches[a.step] = SentBatch(
            tuple(a.group_ids), now - self._trainer_idle_since, self.waits.take(now),
            episode_record(trajectories))
        self.trainer_worker.submit(a.step, trajectories)

    # ------------------------------------------------------------------ events
    def _handle(self, ev: Event) -> int:
        """Feeds one event to the scheduler; returns the train steps it completed."""
        if isinstance(ev, SamplesFinished):
            self._samples_finished(ev)
        elif isinstance(ev, GroupScored):
            self._scoring.discard(ev.group_id)
            self.sched.group_scored(ev.group_id, not self.cfg.trainer.filter_zero_variance
                                    or self.book.keeps_signal(ev.group_id))
            self._finished_waiting()
        elif isinstance(ev, VersionLoaded):
            self.sched.version_loaded(ev.slice_id, ev.version)
        elif isinstance(ev, StepDone):
            self._step_done(ev)
            return 1
        elif isinstance(ev, EvalGenerated):
            assert self.evaluation is not None  # only a run that evaluates posts these
            self.evaluation.generated(ev)
        elif isinstance(ev, EvalScored):
            assert self.evaluation is not None
            self.reporter.eval(self.evaluation.scored(ev))
        elif isinstance(ev, Failed):
            self._failed(ev)
        else:  # pragma: no cover - only the events above are posted
            raise TypeError(f"unknown event {ev!r}")
        return 0

    def _samples_finished(self, ev: SamplesFinished) -> None:
        self._to_ack.add(ev.slice_id)
        self.book.finished(ev.trajectories)
        for t in ev.trajectories:
            self.sched.sample_finished(t.group_id, t.sample_index, len(t.response_tokens))
            if self.sched.config.score_groups and self.sched.groups[t.group_id].finished:
                # Once every reward is in the group is trainable (the coordinator never
                # waits on the reward pool) or, DAPO's dynamic sampling, a group whose
                # rewards are all equal leaves, and the scheduler admits another.
                gid = t.group_id
                self._scoring.add(gid)
                self.book.when_scored(gid, functools.partial(self._events.put, GroupScored(gid)))
        if ev.kv_free is not None:
            self.sched.kv_reported(ev.slice_id, ev.kv_free)
        self._finished_waiting()
        if sum(sl.num_at_environment for sl in self.slices) >= 4:
            self.faults.run_reached("at_environment")

    def _finished_waiting(self) -> None:
        if self.sched.trainer_busy and self.sched.num_finished_groups:
            self.faults.run_reached("finished_waiting")

    def _failed(self, ev: Failed) -> None:
        if not isinstance(ev.source, str) and (  # a slice's id; the trainer's is TRAINER
                len(self.slice_failures) < self.cfg.coordinator.max_slice_restarts):
            self._restart_slice(ev.source, ev.error)
            return
        trainer = ev.source == TRAINER
        step = self.sched.trainer_step if trainer and self.sched.trainer_busy \
            else self.sched.next_step
        raise RunError(f"{'the trainer' if trainer else f'slice {ev.source}'} failed at "
                       f"step {step}: {type(ev.error).__name__}: {ev.error}") from ev.error

    def _restart_slice(self, i: int, error: BaseException) -> None:
        """A slice raised: its running samples, and migrations out of it that never
        left, are regenerated under their own versions (C1); a fresh loop starts on
        the emptied slice. The ledger and metrics.jsonl record it."""
        in_hand_over = 0
        for (gid, k), dst in self.workers[i].release_hand_overs():
            g = self.sched.groups.get(gid)
            if g is not None and g.samples[k].status == "running" \
                    and g.samples[k].slice_id == dst:
                self.sched.sample_lost(gid, k)
                in_hand_over += 1
        lost = in_hand_over + len(self.sched.slices[i].running)
        self.sched.slice_failed(i)
        if self.evaluation is not None:
            self.evaluation.lost(i)
        self.slices[i].abandon()
        self._to_ack.discard(i)
        self.slice_failures.append((i, self.sched.next_step))
        self.ledger.write("slice_failed", slice=i, step=self.sched.next_step,
                          time=self.clock(), error=f"{type(error).__name__}: {error}",
                          regenerated=lost, in_hand_over=in_hand_over)
        # Without the run's faults: a drill fails a slice once, not its restart.
        self.workers[i] = self._make_worker(self.slices[i], self._events, self.timeline,
                                            self.clock, NO_FAULTS)
        self.workers[i].start()

    def _wait_kind(self) -> str | None:
        """Why the trainer is idle now (`report.WaitClock`), or None if it is busy."""
        if self.sched.trainer_busy or self.sched.next_step == 0:
            return None if self.sched.trainer_busy else "fill"
        full = self.sched.num_finished_groups >= self.cfg.coordinator.train_batch_size
        return "guard" if full else "starvation"

    def _next_event(self) -> Event:
        """The next event; a RunError naming what each part was doing if none comes
        within `coordinator.stall_timeout` (a lost event would hang the run)."""
        timeout = self.cfg.coordinator.stall_timeout or None
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            self._stalled = True
            now = self.clock()
            doing = [f"{name}: {what} for {now - since:.1f} s" for name, (what, since) in
                     [(f"slice {w.slice_id}", w.doing) for w in self.workers]
                     + [("trainer", self.trainer_worker.doing)]]
            raise RunError(f"the run stalled at step {self.sched.next_step}: no event for "
                           f"coordinator.stall_timeout={timeout:g} s with work outstanding ("
                           f"{len(self._scoring)} group(s) awaiting rewards); "
                           + "; ".join(doing)) from None

    def _exhausted(self) -> bool:
        """Every prompt the data allows was admitted and nothing is left in flight."""
        m = self.sched.config.max_groups
        return (m is not None and self.sched.next_group_id >= m
                and not self.sched.readmit_queue)

    def _work_in_flight(self) -> bool:
        """Something will post an event: a sample running, a load, or a train step."""
        return (self.sched.trainer_busy or bool(self._scoring)
                or any(sl.running or sl.loading is not None or sl.adding
                       for sl in self.sched.slices))

    # ------------------------------------------------------------------ loop
    def _decide(self) -> None:
        """One decision pass: the actions carried out, the trainer's wait cause
        marked, and every slice with finished samples answered (its loop refills)."""
        self.execute(self.sched.decide())
        self.waits.mark(self.clock(), self._wait_kind())
        resident = {v for sl in self.sched.slices
                    for v in (sl.effective_version, *sl.held, *sl.adding)} - {None}
        self.max_resident_versions = max(self.max_resident_versions, len(resident))
        for i in self._to_ack:
            self.workers[i].ack()
        self._to_ack.clear()

    def run(self, num_steps: int) -> dict:
        """Runs until `num_steps` train steps finished; returns the run summary."""
        for w in self.workers:
            w.start()
        self.trainer_worker.start()
        steps_done = 0
        try:
            v = self.trainer.version  # the policy before this run's training
            self._evaluate(v, self.weights.for_load(v))
            self.waits.mark(self._trainer_idle_since, self._wait_kind())
            self._decide()
            while steps_done < num_steps:
                if not self._work_in_flight():
                    if self._exhausted():  # a finite prompt set, trained to its end
                        break
                    raise RuntimeError("no slice holds work, none is loading and the "
                                       "trainer is idle: the run cannot progress (pending "
                                       f"samples by version {self.sched.pending_by_version()}, "
                                       f"next step {self.sched.next_step})")
                steps_done += self._handle(self._next_event())
                while steps_done < num_steps:  # take every event already posted
                    try:
                        steps_done += self._handle(self._events.get_nowait())
                    except queue.Empty:
                        break
                if steps_done < num_steps:
                    self._decide()
            if self.evaluation is not None:
                v = self.trainer.version
                self.evaluation.finish(
                    lambda: self._evaluate(v, self.weights.for_load(v), last=True),
                    lambda: self._handle(self._next_event()))
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
        summary["slice_failures"] = summary.get("slice_failures", 0) + len(self.slice_failures)
        summary["prompts_exhausted"] = steps_done < num_steps
        # Forward passes over prompts (re-prefills included) per admitted group.
        summary["prefills_per_group"] = round(sum(sl.stats.prefills for sl in self.slices)
                                              / max(self.sched.next_group_id, 1), 3)
        return summary

    def _finish(self) -> None:
        """The ledger's final lines, then the threads stopped even if writing them
        fails (a full disk): the caller still closes the checkpointer."""
        try:
            self.book.write_unconsumed(self.sched.readmit_queue)
        finally:
            wait = 5.0 if self._stalled else 600.0
            self.trainer_worker.close()
            for w in self.workers:
                w.stop(timeout=wait)
            self.trainer_worker.join(timeout=wait)
