"""Plain data for the scheduling core: configuration, actions and state records.

Nothing here has behaviour beyond validation; the `Scheduler` (core.py) owns the
state records and the policies (policies.py, dora.py) read them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from dora_jax.config import (
    Config,
    ConfigError,
    CoordinatorConfig,
    MeshConfig,
    RolloutConfig,
    check_declared,
    check_group_fits,
    check_not_retired,
    check_rollout_batch,
    check_versions,
)

# Sample status values. Strings rather than an Enum so a snapshot is plain JSON.
PENDING = "pending"
RUNNING = "running"
FINISHED = "finished"


@dataclass(frozen=True)
class SchedulerConfig:
    """Static shape of a run, shared by every mode.

    Attributes:
      mode: one of `dora_jax.config.MODES` (a policy in `modes.POLICIES`).
      num_slices: number of decode slices S.
      slots_per_slice: decode slots per slice (same for every slice).
      episodes_per_slice: samples a slice holds at once when multi-turn episodes give
        up their slot during environment calls (`rollout.max_episodes_per_slice`);
        0: one per slot. The scheduler's capacity is `samples_per_slice`.
      group_size: samples per group G (the GRPO group).
      train_batch_size: TBS, groups consumed by one train step.
      rollout_batch_size: RBS, target number of admitted-but-unconsumed groups
        (dora, partial_rollout: RBS x G samples admitted and not finished)
        (used by `partial_rollout` and `dora`; `sync` and `one_step_off` admit whole
        batches of TBS and ignore it).
      max_staleness: K, a group of version w may be consumed by step t only if
        t - w <= K (each policy says which bound it guarantees: `staleness_bound`).
      max_groups: optional cap on the total number of groups ever admitted (dataset
        size or run budget). None = unbounded.
      admit_tokens: KV positions a newly assigned sample is counted as taking on a
        slice with a paged KV cache (its longest prompt plus one decode call): a
        slice takes no more samples than its last reported free positions allow
        (`Scheduler.kv_reported`). 0: capacity in slots only.
      score_groups: a finished group is trained only once the driver has scored it
        (`Scheduler.group_scored`; a run always does, so that its coordinator never
        waits on a reward), which may filter it out instead (DAPO's dynamic
        sampling); its admission room then goes to a new group.
      versions_per_slice: V, versions a slice may hold at once (residency.py); 1: one
        version per slice, switched only once the slice is empty. Only a mode whose
        policy has `multi_version` uses V > 1; the others hold one version per slice
        by their definition (uniform versions, or every slice moved to the newest).
    """

    mode: str
    num_slices: int
    slots_per_slice: int
    group_size: int
    train_batch_size: int
    rollout_batch_size: int
    max_staleness: int
    max_groups: int | None = None
    admit_tokens: int = 0
    score_groups: bool = False
    versions_per_slice: int = 1
    episodes_per_slice: int = 0

    def __post_init__(self):
        """Checks the shape by the run config's rules on it (dora_jax.config), naming
        the run config's fields; a config built directly (tests, the simulator) and one
        read from a run config (`from_config`) alike."""
        check_not_retired(self.mode)
        for name in ("mode", "group_size", "train_batch_size", "rollout_batch_size",
                     "max_staleness"):
            check_declared(CoordinatorConfig, name, getattr(self, name))
        check_rollout_batch(self.rollout_batch_size, self.train_batch_size)
        check_declared(MeshConfig, "num_slices", self.num_slices)
        check_declared(RolloutConfig, "slots_per_slice", self.slots_per_slice)
        check_group_fits(self.group_size, self.num_slices, self.slots_per_slice)
        check_versions(self.versions_per_slice, self.max_staleness)
        if 0 < self.episodes_per_slice < self.slots_per_slice:
            raise ConfigError(f"episodes_per_slice {self.episodes_per_slice} < "
                              f"slots_per_slice {self.slots_per_slice}")
        if self.max_groups is not None and self.max_groups < 0:
            raise ConfigError(f"max_groups must be >= 0 or None, got {self.max_groups}")
        if self.admit_tokens < 0:
            raise ConfigError(f"admit_tokens must be >= 0, got {self.admit_tokens}")

    @classmethod
    def from_config(cls, cfg: Config, max_groups: int | None = None) -> SchedulerConfig:
        """The scheduler's view of a validated run config, checked as any other."""
        c, r = cfg.coordinator, cfg.rollout
        paged = r.kv_cache == "paged"
        return cls(mode=c.mode, num_slices=cfg.mesh.num_slices,
                   slots_per_slice=r.slots_per_slice, group_size=c.group_size,
                   train_batch_size=c.train_batch_size,
                   rollout_batch_size=c.rollout_batch_size, max_staleness=c.max_staleness,
                   max_groups=max_groups,
                   admit_tokens=r.max_prefill_length + r.decode_steps if paged else 0,
                   # A run trains a group once its rewards are in (filtered or
                   # not), so that its coordinator never waits on the reward pool.
                   score_groups=True,
                   versions_per_slice=r.versions_per_slice,
                   episodes_per_slice=r.max_episodes_per_slice)

    @property
    def samples_per_slice(self) -> int:
        """Samples a slice holds at once (running, or at their environment)."""
        return self.episodes_per_slice or self.slots_per_slice

    @property
    def total_slots(self) -> int:
        return self.num_slices * self.slots_per_slice


# ---------------------------------------------------------------------------
# Actions: what `Scheduler.decide()` asks the runtime to do, in list order.


@dataclass(frozen=True)
class Admit:
    """Admit a new group (next prompt from the data source) tagged with `version`;
    with `readmit`, a group lost in a crash is admitted again under its own id (and
    its own prompt), whole (runtime/recovery.py)."""

    group_id: int
    version: int
    readmit: bool = False


@dataclass(frozen=True)
class Assign:
    """Start generating sample `sample` of `group_id` on `slice_id`, under `version`
    (the slice's resident version; with several versions per slice, the group's,
    resident there).

    In every mode that keeps C1, `version` is the group's; in partial_rollout a
    sample of an older group may start on whatever version its slice now holds (its
    per-token versions say so). The slice had a free slot; it is taken from now on.
    """

    group_id: int
    sample: int
    slice_id: int
    version: int


@dataclass(frozen=True)
class Migrate:
    """Move an in-flight request, with its KV cache and progress, between two slices
    holding the same version. The core treats it as instantaneous: the runtime must
    complete it before executing later actions of the same list."""

    group_id: int
    sample: int
    src_slice: int
    dst_slice: int


@dataclass(frozen=True)
class LoadVersion:
    """Load params `version` onto an empty slice. The slice serves nothing until
    `version_loaded(slice_id, version)`. May be issued to a slice that is still
    loading: the new target supersedes the old one (report only the latest)."""

    slice_id: int
    version: int


@dataclass(frozen=True)
class AddVersion:
    """Multi-version slices (config.versions_per_slice > 1): load `version` into a
    free place of the slice without emptying it; the slice goes on decoding its other
    versions meanwhile and takes requests of `version` once
    `version_loaded(slice_id, version)` is reported."""

    slice_id: int
    version: int


@dataclass(frozen=True)
class Evict:
    """Multi-version slices: drop `version` from the slice, freeing its place. Issued
    only when no request of it runs (or is migrating) there."""

    slice_id: int
    version: int


@dataclass(frozen=True)
class InterruptReload:
    """partial_rollout only: pause the slice, load `version`, re-prefill its in-flight
    requests (prompt + tokens so far) and continue them under the new version once
    `version_loaded(slice_id, version)` is reported."""

    slice_id: int
    version: int


@dataclass(frozen=True)
class TrainStep:
    """Run train step `step` on exactly TBS groups, ordered oldest version first.
    Report `step_finished(step)` when params of version step+1 are published."""

    step: int
    group_ids: tuple


Action = (Admit | Assign | Migrate | LoadVersion | AddVersion | Evict | InterruptReload
          | TrainStep)


# ---------------------------------------------------------------------------
# State records held by the Scheduler. Mutable, but only the Scheduler mutates them;
# policies and runtimes treat them as read-only.


@dataclass
class SampleState:
    """One sample (trajectory) of a group."""

    status: str = PENDING
    slice_id: int | None = None  # set while RUNNING
    versions: list = field(default_factory=list)  # versions it ran under, in order
    slices: list = field(default_factory=list)  # slices it ran on, in order
    num_tokens: int | None = None  # reported by sample_finished, informational


@dataclass
class GroupState:
    """An admitted, not yet consumed group."""

    group_id: int
    version: int
    samples: list
    n_pending: int = 0
    n_running: int = 0
    n_finished: int = 0
    scored: bool = True  # False until `Scheduler.group_scored` (config.score_groups)

    @property
    def finished(self) -> bool:
        return self.n_finished == len(self.samples)

    @property
    def trainable(self) -> bool:
        """Finished and, if the run scores groups before training, scored."""
        return self.finished and self.scored


@dataclass
class SliceState:
    """A decode slice as the scheduler sees it."""

    slice_id: int
    version: int | None  # resident params; None = holds no params
    loading: int | None = None  # target version while a load is in progress
    interrupted: bool = False  # the load is an InterruptReload (requests kept, paused)
    running: set = field(default_factory=set)  # {(group_id, sample)}
    # Paged KV: free positions as last reported, less admit_tokens per sample given
    # to the slice since; None: never reported (capacity in slots only).
    kv_free: int | None = None
    # Versions resident ({version} with one version per slice) and being added
    # (AddVersion in progress), and running requests per group version: residency.py.
    held: set = field(default_factory=set)
    adding: set = field(default_factory=set)
    in_use: Counter = field(default_factory=Counter)

    def __post_init__(self):
        if self.version is not None and not self.held:
            self.held = {self.version}

    @property
    def serving(self) -> bool:
        """True if the slice can take new requests of its resident version."""
        return self.loading is None and self.version is not None

    def serves(self, version: int) -> bool:
        """True if the slice can take a new request of `version` now (several
        versions per slice: residency.py)."""
        return self.loading is None and version in self.held

    def add_resident(self, version: int) -> None:
        """`version_loaded` for an AddVersion: the version is resident from now on."""
        self.adding.discard(version)
        self.held.add(version)
        self.version = max(self.held)

    @property
    def effective_version(self) -> int | None:
        """The version the slice holds or is about to hold."""
        return self.loading if self.loading is not None else self.version
