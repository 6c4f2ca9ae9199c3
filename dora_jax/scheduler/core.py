"""The deterministic, event-driven scheduling core.

Events (`sample_finished`, `version_loaded`, `step_finished`) record what happened and
decide nothing; `decide()` asks the mode's policy (modes.py) for every action due now,
applies their effect as if issued, and returns them in execution order. No clock,
thread, randomness or engine lives here, so the JAX runtime, the simulator and the
tests' fake engine drive this very object through driver.py.

What a runtime must know: a Migrate moves its slot when `decide()` returns it; slices
start holding version 0; a LoadVersion / InterruptReload may name the version in
training (published + 1), which the driver loads, the slice idle, once published;
group ids count from 0 in admission order (group i is the data source's i-th prompt);
consumed groups leave `groups`, so provenance comes from the executed actions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from . import failures, invariants, residency
from .modes import policy_for
from .state import SchedulerState
from .types import (
    FINISHED,
    AddVersion,
    Evict,
    GroupState,
    SampleState,
    SchedulerConfig,
    SliceState,
)


class Scheduler(SchedulerState):
    """Scheduling state plus the event API (state.py); the mode's policy makes the
    decisions.

    Read-only attributes for runtimes: `config`, `policy`, `published` (newest
    published version), `next_step` (index of the next TrainStep), `trainer_step`
    (step being trained, or None), `next_group_id`, `groups` (unconsumed groups by id,
    in admission order) and `slices` (list of `SliceState`).
    """

    # decide() repeats policy passes until one yields nothing; a pass count this high
    # means a policy keeps undoing itself, which is a bug worth failing loudly on.
    _MAX_PASSES = 10_000

    def __init__(self, config: SchedulerConfig):
        self.policy = policy_for(config.mode)
        super().__init__(config)

    @classmethod
    def resumed(cls, config: SchedulerConfig, *, published: int, next_group_id: int,
                filtered: int, kept: Mapping[int, int],
                readmit: Iterable[int] = ()) -> Scheduler:
        """The state a run resumes from (runtime/recovery.py): version `published`
        published and held by every slice, the trainer idle, the `kept` groups
        ({group id: version}) finished and scored, the `readmit` group ids admitted
        again before new ones; `filtered` is the run's count so far."""
        sched = cls(config)
        sched.published = sched.next_step = published
        sched.next_group_id = next_group_id
        sched.filtered = filtered
        sched.slices = [SliceState(i, published) for i in range(config.num_slices)]
        G = config.group_size
        for gid, version in sorted(kept.items()):
            samples = [SampleState(FINISHED, None, [version], []) for _ in range(G)]
            sched.groups[gid] = GroupState(gid, version, samples, n_finished=G)
        sched.readmit_queue.extend(readmit)
        sched._recount()
        sched.check_invariants()
        return sched

    # ------------------------------------------------------------------ decide

    def decide(self) -> list:
        """Return every action to execute now, in order, and apply their effect.

        Policy passes repeat until one produces nothing, so a second call with no
        event in between returns []."""
        out = []
        for _ in range(self._MAX_PASSES):
            acts = self.policy.plan(self)
            if not acts:
                break
            out.extend(acts)
        else:
            raise RuntimeError("decide() found no fixpoint: a policy undoes itself")
        self.settled = True
        return out

    # ---------------------------------------------- mutators used by policies only

    def do_add_version(self, slice_id: int, version: int) -> AddVersion:
        """AddVersion (residency.py): `version` into a free place of the slice."""
        return residency.add_version(self, slice_id, version)

    def do_evict(self, slice_id: int, version: int) -> Evict:
        """Evict (residency.py): an unused version leaves the slice."""
        return residency.evict(self, slice_id, version)

    # ------------------------------------------------------------------ recovery

    def slice_failed(self, slice_id: int):
        """A slice failed and lost everything it held: its running samples are
        pending again, and the slice holds no params until told to load some."""
        failures.slice_failed(self, slice_id)

    # ------------------------------------------------------------------ invariants

    def check_invariants(self):
        """Raise InvariantError if the state breaks a rule of the core or the mode
        (invariants.py). Cheap enough (linear in in-flight samples) to call after
        every event."""
        invariants.check(self, self.policy)
