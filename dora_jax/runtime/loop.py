"""The run loop: drives real decode slices and the trainer from the scheduling core.

One coordinator thread owns the `Scheduler` and executes its actions; decode
slices step concurrently on a thread pool (each on its own sub-mesh); the trainer
runs in its own thread, fed through the Grain trajectory stream, so decoding goes
on while it trains. Rewards are computed on host threads as samples finish.

Weights: after step t the trainer's params (version t+1) are copied on the trainer
mesh — the next step donates the originals — and slices told to load that version
get them through `jax.device_put` to their own shardings. The README's "Life of a
group" names the function at each hop from admission to the ledger.
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
from dora_jax.data.tasks import RewardPool
from dora_jax.model.sharding import copy_tree
from dora_jax.rollout.trajectory import Request
from dora_jax.runtime.report import StepReporter
from dora_jax.runtime.stream import GroupQueue, train_batches
from dora_jax.scheduler.core import Scheduler
from dora_jax.scheduler.ledger import LedgerWriter
from dora_jax.scheduler.types import (Admit, Assign, InterruptReload, LoadVersion, Migrate,
                                      TrainStep)
from dora_jax.timeline import Timeline


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
      slices: `DecodeSlice`s on disjoint sub-meshes, ids 0..S-1.
      trainer: an `rl.trainer.Trainer` on the trainer mesh.
      prompts: the prompt stream (Grain).
      rewards: the host reward pool.
      ledger: where admit/consume/unconsumed events go.
      reporter: per-step metrics (metrics.jsonl) and the run summary.
      on_step: called with each step's metrics record (progress bar).
      checkpointer: if given, `save_checkpoint` is called every
        `coordinator.checkpoint_every` steps.
    """

    def __init__(self, cfg, scheduler: Scheduler, slices, trainer, prompts: PromptStream,
                 rewards: RewardPool, ledger: LedgerWriter, reporter: StepReporter,
                 timeline: Timeline, on_step: Callable[[dict], None] = lambda m: None,
                 checkpointer=None, clock: Callable[[], float] = time.perf_counter):
        self.cfg, self.sched, self.slices, self.trainer = cfg, scheduler, slices, trainer
        self.prompts, self.rewards, self.ledger = prompts, rewards, ledger
        self.reporter, self.timeline, self.on_step = reporter, timeline, on_step
        self.checkpointer = checkpointer
        self._saved_version = None
        self._t0 = clock()
        self.clock = lambda: clock() - self._t0
        self.groups: dict[int, _Group] = {}
        # Params of the versions slices may load. A copy: step 0 donates the
        # trainer's own buffers.
        self.params_by_version = {0: copy_tree(trainer.params)}
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, len(slices)), "slice")
        self._stream = GroupQueue()
        self._done: queue.Queue = queue.Queue()
        self._inflight_batches: dict[int, tuple] = {}
        self._trainer_idle_since = 0.0
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
                metrics = jax.device_get(metrics)  # the step's only host sync
                # Publish: keep a copy, as the next step donates the trainer's params.
                params = copy_tree(self.trainer.params)
                jax.block_until_ready(params)
                end = self.clock()
                self.timeline.add("trainer", "train", start, end, step)
                self._done.put((step, batch, metrics, params, start, end))
        except BaseException as e:  # surfaced in the coordinator thread
            self._done.put(e)

    def _on_step_done(self, item):
        if isinstance(item, BaseException):
            raise RuntimeError("train step failed") from item
        step, batch, metrics, params, start, end = item
        self.sched.step_finished(step)
        self.params_by_version = {step + 1: params}  # slices only ever load the newest
        self._trainer_idle_since = end
        group_ids, wait = self._inflight_batches.pop(step)
        for gid in group_ids:
            g = self.groups.pop(gid)
            self.ledger.write("consume", group_id=gid, prompt_id=g.record["prompt_id"],
                              version=g.version, step=step, time=end,
                              samples=[self._sample_entry(g, k) for k in sorted(g.trajectories)])
        record = self.reporter.step(step, batch, metrics, wait=wait, train_time=end - start,
                                    now=end, slices=self.slices, scheduler=self.sched)
        every = self.cfg.coordinator.checkpoint_every
        if self.checkpointer is not None and every and (step + 1) % every == 0:
            self.save_checkpoint()
        self.on_step(record)

    def save_checkpoint(self) -> None:
        """Saves the train state with everything the coordinator knows (scheduler
        snapshot, prompt-stream state, the prompt of every unconsumed group).

        Called between steps from the coordinator thread: the trainer is idle (it
        only gets a batch from `decide()`), so its state is not being donated."""
        if self.trainer.version == self._saved_version:
            return
        self._saved_version = self.trainer.version
        self.checkpointer.save(self.trainer.version, self.trainer.state, {
            "scheduler": self.sched.snapshot(),
            "prompt_stream": self.prompts.get_state(),
            "groups": {str(gid): {"prompt_id": g.record["prompt_id"], "version": g.version}
                       for gid, g in self.groups.items()},
        }, force=True)

    @staticmethod
    def _sample_entry(g: _Group, k: int) -> dict:
        t = g.trajectories[k]
        reward, error = g.rewards[k].result()
        entry = {"sample": k, "versions": t.versions, "slices": t.slice_ids,
                 "response_len": len(t.response_tokens), "finish": t.finish_reason,
                 "reward": reward}
        if error:
            entry["reward_error"] = error
        return entry

    # ------------------------------------------------------------------ actions
    def _execute(self, actions):
        for a in actions:
            if isinstance(a, Admit):
                self._admit(a)
            elif isinstance(a, Assign):
                g = self.groups[a.group_id]
                self.slices[a.slice_id].submit(Request(
                    group_id=a.group_id, prompt_id=g.record["prompt_id"], sample_index=a.sample,
                    prompt_tokens=g.record["tokens"], version=g.version,
                    seed=request_seed(self.cfg.seed, a.group_id, a.sample)))
            elif isinstance(a, Migrate):
                src, dst = self.slices[a.src_slice], self.slices[a.dst_slice]
                dst.import_requests(src.export_requests([(a.group_id, a.sample)]))
                self.reporter.migrations += 1
            elif isinstance(a, (LoadVersion, InterruptReload)):
                self._load(a)
            elif isinstance(a, TrainStep):
                self._train(a)
            else:  # pragma: no cover - the core emits only the types above
                raise TypeError(f"unknown action {a!r}")

    def _admit(self, a: Admit):
        record = self.prompts.next()
        if record is None:
            raise RuntimeError(f"prompt source exhausted at group {a.group_id}")
        self.groups[a.group_id] = _Group(record, a.version)
        self.ledger.write("admit", group_id=a.group_id, prompt_id=record["prompt_id"],
                          version=a.version, time=self.clock())

    def _load(self, a):
        params = self.params_by_version.get(a.version)
        if params is None:
            raise RuntimeError(f"version {a.version} is not published "
                               f"(have {list(self.params_by_version)})")
        sl = self.slices[a.slice_id]
        start = self.clock()
        if isinstance(a, InterruptReload):
            seconds = sl.interrupt_and_reload(a.version, params)
        else:
            seconds = sl.load_version(a.version, params)
        self.reporter.transfer_seconds += seconds
        self.timeline.add(f"slice {a.slice_id}", "load", start, self.clock(), a.version)
        self.sched.version_loaded(a.slice_id, a.version)

    def _train(self, a: TrainStep):
        """Form the batch: the step's groups, scored, go into the trajectory stream."""
        trajectories = []
        for gid in a.group_ids:
            g = self.groups[gid]
            for k in sorted(g.trajectories):
                t = g.trajectories[k]
                t.reward, _ = g.rewards[k].result()
                trajectories.append(t)
        wait = self.clock() - self._trainer_idle_since
        self._inflight_batches[a.step] = (a.group_ids, wait)
        self._stream.put(a.step, trajectories)

    # ------------------------------------------------------------------ decoding
    def _step_slice(self, sl):
        start = self.clock()
        version = sl.version
        finished = sl.step()
        self.timeline.add(f"slice {sl.slice_id}", "decode", start, self.clock(), version)
        return finished

    def _decode(self) -> bool:
        """One generate step on every slice holding requests; False if none does."""
        active = [sl for sl in self.slices if sl.num_requests]
        if not active:
            return False
        for finished in self._pool.map(self._step_slice, active):
            for t in finished:
                g = self.groups[t.group_id]
                g.trajectories[t.sample_index] = t
                g.rewards[t.sample_index] = self.rewards.submit(g.record, t.response_tokens)
                self.sched.sample_finished(t.group_id, t.sample_index, len(t.response_tokens))
        return True

    # ------------------------------------------------------------------ loop
    def run(self, num_steps: int) -> dict:
        """Runs until `num_steps` train steps finished; returns the run summary."""
        self._trainer_thread.start()
        steps_done = 0
        try:
            while steps_done < num_steps:
                while True:
                    try:
                        item = self._done.get_nowait()
                    except queue.Empty:
                        break
                    self._on_step_done(item)
                    steps_done += 1
                if steps_done >= num_steps:
                    break
                # Loads complete synchronously (version_loaded is reported inside
                # _execute), so decide again until the core has nothing more to say.
                while actions := self.sched.decide():
                    self._execute(actions)
                if not self._decode():
                    # Nothing to decode: the trainer holds all the work; wait for it.
                    if not self.sched.trainer_busy:
                        raise RuntimeError(
                            "no slice holds work and the trainer is idle: the run cannot "
                            f"progress; scheduler state: {self.sched.snapshot()}")
                    item = self._done.get()
                    self._on_step_done(item)
                    steps_done += 1
        finally:
            self._stream.close()
            self._trainer_thread.join(timeout=600)
            self._pool.shutdown(wait=True)
        for gid, g in sorted(self.groups.items()):
            self.ledger.write("unconsumed", group_id=gid, version=g.version)
        return self.reporter.summary(self.slices)
