"""The scheduling core's state: groups, samples, slices, versions and the counters
over them, the events that record what happened (`sample_finished`,
`version_loaded`, `step_finished`, ...) and the mutators a policy applies (`do_admit`,
`do_assign`, ...). It decides nothing and knows no policy: what the mode may do is
its row of the config's capabilities table (config/modes.py). The policies, the
feasibility rules, lost work (failures.py), residency and the invariants all act on
this state; the `Scheduler` (core.py) adds the mode's policy and `decide()`."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator

from dora_jax.config.modes import CAPABILITIES, Capabilities

from .types import (
    FINISHED,
    PENDING,
    RUNNING,
    Admit,
    Assign,
    GroupState,
    InterruptReload,
    LoadVersion,
    Migrate,
    SampleState,
    SchedulerConfig,
    SliceState,
    TrainStep,
)


class SchedulerState:
    """Scheduling state plus the events and the mutators; no decisions.

    Read-only attributes for runtimes: `config`, `caps` (what the mode can do),
    `multi` (several versions per slice), `published` (newest published version),
    `next_step` (index of the next TrainStep), `trainer_step` (step being trained, or
    None), `next_group_id`, `groups` (unconsumed groups by id, in admission order)
    and `slices` (list of `SliceState`).
    """

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.caps: Capabilities = CAPABILITIES[config.mode]
        # Several versions per slice (residency.py), for a mode that uses them.
        self.multi = config.versions_per_slice > 1 and self.caps.multi_version
        self.published = 0
        self.next_step = 0
        self.trainer_step: int | None = None
        self.next_group_id = 0
        # Ids of groups lost in a crash, admitted again (in order) before new ones.
        self.readmit_queue: deque = deque()
        self.groups: dict[int, GroupState] = {}
        self.filtered = 0  # groups that left without training (group_scored)
        self.slices = [SliceState(i, 0) for i in range(config.num_slices)]
        # False between a step_finished event and the next decide(): slices may still
        # hold a version that just left the staleness window.
        self.settled = True
        self._recount()

    # ------------------------------------------------------------------ queries

    @property
    def trainer_busy(self) -> bool:
        return self.trainer_step is not None

    def free_slots(self, sl: SliceState) -> int:
        """Samples the slice can take now: its free places (slots, or episodes with
        `episodes_per_slice`), and with a paged KV cache no more than its reported free
        positions hold (see `kv_reported`)."""
        n = self.config.samples_per_slice - len(sl.running)
        if self.config.admit_tokens and sl.kv_free is not None:
            n = min(n, max(0, sl.kv_free // self.config.admit_tokens))
        return n

    def unconsumed_by_version(self) -> Counter:
        """Unconsumed groups per version (a copy)."""
        return Counter(self._unconsumed_v)

    def unfinished_by_version(self) -> Counter:
        """Pending + running samples per version (a copy)."""
        return Counter(self._unfinished_v)

    @property
    def num_unfinished_samples(self) -> int:
        """Pending + running samples of every version (no copy)."""
        return sum(self._unfinished_v.values())

    def pending_by_version(self) -> Counter:
        """Pending (not yet assigned) samples per version (a copy)."""
        return Counter(self._pending_v)

    def has_pending(self) -> bool:
        """True if some sample waits for a slot."""
        return bool(self._pending_v)  # a version leaves it at none pending (`_take`)

    def pending_versions(self) -> list:
        """Versions with pending samples, oldest first."""
        return sorted(self._pending_v)

    def pending_of_version(self, version: int) -> Iterator[tuple[GroupState, int]]:
        """(group, sample index) of the pending samples of `version`, oldest group
        first (a FIFO kept in admission order: no scan of the other samples)."""
        q = self._pending_q.get(version)
        if q is None:
            return
        while q and self._stale(q[0]):  # assigned since queued
            q.popleft()
        if not q:
            del self._pending_q[version]
            return
        for i in range(len(q)):  # by index: the caller may assign while iterating
            if i >= len(q):
                return
            gid, k = q[i]
            if not self._stale(q[i]):
                yield self.groups[gid], k

    def _stale(self, entry) -> bool:
        g = self.groups.get(entry[0])
        return g is None or g.samples[entry[1]].status != PENDING

    @property
    def num_finished_groups(self) -> int:
        """Trainable (finished, and scored if the run scores), unconsumed groups (a
        counter: no scan)."""
        return len(self._trainable)

    def trainable_group_ids(self) -> set:
        """Ids of the trainable unconsumed groups (a copy)."""
        return set(self._trainable)

    def finished_groups(self) -> list[GroupState]:
        """Trainable unconsumed groups, oldest version then oldest group first."""
        groups = [self.groups[gid] for gid in self._trainable]
        return sorted(groups, key=lambda g: (g.version, g.group_id))

    def admission_room(self, target: int) -> int:
        """How many more groups may be admitted to reach `target` unconsumed groups,
        also respecting `config.max_groups`."""
        room = target - len(self.groups)
        if self.config.max_groups is not None:
            room = min(room, self.config.max_groups - self.next_group_id
                       + len(self.readmit_queue))
        return max(room, 0)

    # ------------------------------------------------------------------ events

    def sample_finished(self, group_id: int, sample: int, num_tokens: int | None = None):
        """A running sample ended (EOS or max length); its slot is free again."""
        g = self.groups.get(group_id)
        if g is None or not 0 <= sample < len(g.samples):
            raise ValueError(f"sample_finished: unknown sample ({group_id}, {sample})")
        smp = g.samples[sample]
        if smp.status != RUNNING:
            raise ValueError(f"sample_finished: ({group_id}, {sample}) is {smp.status}")
        self._leave(self.slices[smp.slice_id], (group_id, sample))
        smp.status, smp.slice_id, smp.num_tokens = FINISHED, None, num_tokens
        g.n_running -= 1
        g.n_finished += 1
        _take(self._unfinished_v, g.version)
        if g.trainable:
            self._trainable.add(group_id)

    def group_scored(self, group_id: int, keep: bool):
        """The driver scored a finished group (`config.score_groups`): it becomes
        trainable, or (keep=False) it leaves without training, filtered: the driver
        records why (a ledger `filter` event), and its room goes to a new group."""
        g = self.groups.get(group_id)
        if g is None or not g.finished or g.scored:
            raise ValueError(f"group_scored: group {group_id} is not finished and unscored")
        g.scored = True
        if keep:
            self._trainable.add(group_id)
        else:
            del self.groups[group_id]
            _take(self._unconsumed_v, g.version)
            self.filtered += 1

    def kv_reported(self, slice_id: int, free_tokens: int):
        """A slice with a paged KV cache reports the positions it has free (beyond
        what its running and queued requests need next). Ignored for a slice that
        holds nothing here: its pool is free, and the bound takes effect between
        decisions, never within one (each assignment lowers `free_slots` by one)."""
        sl = self.slices[slice_id]
        sl.kv_free = int(free_tokens) if sl.running else None

    def version_loaded(self, slice_id: int, version: int):
        """A LoadVersion / InterruptReload finished: the slice now holds `version`.

        A report for a target that a later LoadVersion superseded is ignored."""
        sl = self.slices[slice_id]
        if version in sl.adding:  # an AddVersion (several versions per slice)
            return sl.add_resident(version)
        if sl.loading is None:
            raise ValueError(f"version_loaded: slice {slice_id} is not loading")
        if version > self.published:
            raise ValueError(f"version_loaded: version {version} is not published yet "
                             f"(published {self.published}): the load must wait for it")
        if sl.loading != version:
            return  # superseded load; the latest target will be reported later
        sl.version, sl.loading, sl.held = version, None, {version}
        if sl.interrupted:
            # The paused requests continue under the new params from here on.
            for gid, k in sl.running:
                vs = self.groups[gid].samples[k].versions
                if vs[-1] != version:
                    vs.append(version)
            sl.interrupted = False

    def step_finished(self, step: int):
        """Train step `step` is done: version step+1 is published."""
        if self.trainer_step != step:
            raise ValueError(f"step_finished({step}) but trainer runs {self.trainer_step}")
        self.trainer_step = None
        self.published = step + 1
        self.settled = False

    # ---------------------------------------------- mutators used by policies only

    def do_admit(self, version: int) -> Admit:
        readmit = bool(self.readmit_queue)
        if readmit:
            gid = self.readmit_queue.popleft()
        else:
            gid = self.next_group_id
            self.next_group_id += 1
        G = self.config.group_size
        self.groups[gid] = GroupState(gid, version, [SampleState() for _ in range(G)],
                                      n_pending=G, scored=not self.config.score_groups)
        self._unconsumed_v[version] += 1
        self._unfinished_v[version] += G
        self._pending_v[version] += G
        self._pending_q.setdefault(version, deque()).extend((gid, k) for k in range(G))
        return Admit(gid, version, readmit)

    def do_assign(self, group_id: int, sample: int, slice_id: int) -> Assign:
        g, sl = self.groups[group_id], self.slices[slice_id]
        smp = g.samples[sample]
        # Several versions per slice: the group's version, resident there (C1).
        v = g.version if self.multi else sl.version
        assert v is not None and smp.status == PENDING and self.free_slots(sl) > 0 and (
            sl.serves(v) if self.multi else sl.serving)
        smp.status, smp.slice_id = RUNNING, slice_id
        smp.versions.append(v)
        smp.slices.append(slice_id)
        sl.running.add((group_id, sample))
        sl.in_use[g.version] += 1
        self._reserve_kv(sl)
        g.n_pending -= 1
        g.n_running += 1
        _take(self._pending_v, g.version)
        return Assign(group_id, sample, slice_id, v)

    def do_migrate(self, group_id: int, sample: int, dst: int) -> Migrate:
        g = self.groups[group_id]
        smp = g.samples[sample]
        src_sl, dst_sl = self.slices[smp.slice_id], self.slices[dst]
        # C1: a migrated request keeps its version, so the destination must hold it.
        assert smp.status == RUNNING and (dst_sl.serves(g.version) if self.multi
                                          else dst_sl.serving and dst_sl.version == src_sl.version)
        assert self.free_slots(dst_sl) > 0 and src_sl.loading is None
        src = smp.slice_id
        self._leave(src_sl, (group_id, sample))
        dst_sl.running.add((group_id, sample))
        dst_sl.in_use[g.version] += 1
        self._reserve_kv(dst_sl)
        smp.slice_id = dst
        smp.slices.append(dst)
        return Migrate(group_id, sample, src, dst)

    def _leave(self, sl: SliceState, request):
        if request in sl.running:
            sl.running.remove(request)
            sl.in_use -= Counter({self.groups[request[0]].version: 1})
        if not sl.running:
            sl.kv_free = None  # an empty slice's pool is free: its report is stale

    def _reserve_kv(self, sl: SliceState):
        if sl.kv_free is not None:
            sl.kv_free -= self.config.admit_tokens

    def do_load(self, slice_id: int, version: int) -> LoadVersion:
        sl = self.slices[slice_id]
        assert not sl.running, "C1: LoadVersion only on an empty slice"
        assert self._loadable(version)
        sl.loading, sl.interrupted = version, False
        return LoadVersion(slice_id, version)

    def do_interrupt_reload(self, slice_id: int, version: int) -> InterruptReload:
        assert not self.caps.keeps_c1, "a C1-keeping mode never reloads under requests"
        sl = self.slices[slice_id]
        assert sl.loading is None and self._loadable(version)
        sl.loading, sl.interrupted = version, True
        return InterruptReload(slice_id, version)

    def _loadable(self, version: int) -> bool:
        """A published version, or the one in training (its load is deferred by the
        driver until it is published: see the module docstring)."""
        return version <= self.published + self.trainer_busy

    def do_train(self, group_ids: list[int]) -> TrainStep:
        assert not self.trainer_busy and len(group_ids) == self.config.train_batch_size
        for gid in group_ids:
            g = self.groups.pop(gid)
            assert g.trainable, "C2: only complete (and scored) groups are trained"
            _take(self._unconsumed_v, g.version)
            self._trainable.discard(gid)
        step = self.next_step
        self.trainer_step = step
        self.next_step += 1
        return TrainStep(step, tuple(group_ids))

    # ------------------------------------------------------------------ lost work

    def sample_lost(self, group_id: int, sample: int):
        """A running sample's progress is gone (its slice failed, or a migration
        never arrived): it leaves its slice and is pending again under its group's
        version (C1), at the head of that version's queue: regenerated first, being
        the oldest work."""
        g = self.groups[group_id]
        smp = g.samples[sample]
        if smp.status != RUNNING:
            raise ValueError(f"sample_lost: ({group_id}, {sample}) is {smp.status}")
        self._leave(self.slices[smp.slice_id], (group_id, sample))
        smp.status, smp.slice_id, smp.versions, smp.slices = PENDING, None, [], []
        g.n_running -= 1
        g.n_pending += 1
        self._pending_v[g.version] += 1
        self._pending_q.setdefault(g.version, deque()).appendleft((group_id, sample))

    def _recount(self):
        """Rebuild the per-version counters from the groups."""
        self._unconsumed_v: Counter[int] = Counter()
        self._unfinished_v: Counter[int] = Counter()
        self._pending_v: Counter[int] = Counter()
        self._pending_q: dict = {}  # version -> deque of (group, sample), group order
        self._trainable: set = set()  # group ids of the trainable unconsumed groups
        for gid in sorted(self.groups):
            g = self.groups[gid]
            self._unconsumed_v[g.version] += 1
            if g.n_pending + g.n_running:
                self._unfinished_v[g.version] += g.n_pending + g.n_running
            if g.n_pending:
                self._pending_v[g.version] += g.n_pending
            if g.trainable:
                self._trainable.add(gid)
            q = self._pending_q.setdefault(g.version, deque())
            q.extend((gid, k) for k, smp in enumerate(g.samples) if smp.status == PENDING)


def _take(per_version: Counter, version: int) -> None:
    """One fewer of `version`; a version down to none leaves the counter, so that the
    queries walking it cost the versions in flight, not every version of the run."""
    per_version[version] -= 1
    if not per_version[version]:
        del per_version[version]
