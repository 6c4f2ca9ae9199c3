"""The run config's own sections: the decode engine and slices (`rollout`), the train
step (`trainer`) and the schedule (`coordinator`), with the allowed values of their
fields; each checks its own rules (schema.py). The model, mesh, data and report
sections are in model.py, data.py and report.py; the rules that span sections in
run.py (on plain values: rules.py)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from .modes import MODES, check_not_retired
from .schema import Section, fail, field

# Allowed values: each list has its one owner here.
FAIL_POINTS = ("generate", "load", "export", "import")  # runtime/faults.py
FAIL_NO_SLICE, FAIL_ANY_SLICE = -1, -2  # coordinator.fail_slice's two special values
KILL_NEVER = ""  # coordinator.kill_point's "no kill"
KILL_POINTS = (KILL_NEVER, "train", "save", "finished_waiting", "at_environment")
ADVANTAGES = ("grpo", "drgrpo", "rloo")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                  "seq-mean-token-sum-norm", "seq-mean-token-sum-over-max-len")
OBJECTIVES = ("behaviour_clip", "decoupled", "tis")  # rl/objective.py
IS_MODES = ("truncate", "mask")
KL_KINDS = ("k1", "k2", "k3")
MOE_ROUTING = ("recompute", "replay")  # rl/trainer.py, rollout/routing.py
SCHEDULES = ("constant", "cosine")
KV_CACHES = ("paged", "dense")  # rollout/engine.py
# model/paged_attention.py
PAGED_ATTENTION_IMPLS = ("auto", "pool", "ragged", "pallas", "pallas_gpu")


def gpu_paged_blocks(pages_per_slot: int, page_size: int, head_dim: int) -> tuple[int, int]:
    """(k_splits, pages_per_compute_block) of the GPU paged-attention kernel: a slot's
    pages split in parts worked on in parallel, each read up to 8 pages at a time.
    Fails, naming the field, on shapes Triton cannot tile (powers of two; a block's
    keys and a head's dims are matmul dimensions of at least 16)."""
    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0
    if not pow2(page_size):
        fail("rollout.page_size", f"must be a power of two with rollout.paged_attention="
                                  f"'pallas_gpu', got {page_size} (or use 'ragged')")
    if not (pow2(head_dim) and head_dim >= 16):
        fail("rollout.paged_attention", f"'pallas_gpu' needs a power-of-two model.head_dim "
                                        f">= 16, got {head_dim}: use 'ragged'")
    # Parts of a power of two of pages (a Triton block), at least 16 of them if the
    # slot has as many pages.
    per_split = max(p for p in (1, 2, 4, 8, 16, 32, 64) if pages_per_slot % p == 0
                    and pages_per_slot // p >= min(16, pages_per_slot))
    k_splits, block = pages_per_slot // per_split, min(per_split, 8)
    if block * page_size < 16:
        fail("rollout.page_size", f"with rollout.paged_attention='pallas_gpu' a slot's "
                                  f"pages ({pages_per_slot}) are read {block} at a time: "
                                  f"{block} x {page_size} positions is under 16; raise it")
    return k_splits, block


@dataclasses.dataclass(frozen=True)
class RolloutConfig(Section):
    """Decode engine and slice settings."""

    PATH: ClassVar[str] = "rollout"
    slots_per_slice: int = field(4, min=1)
    max_prefill_length: int = field(32, min=1)
    max_decode_len: int = field(32, min=1)
    # Most tokens per slot per generate call (one dispatch, one host read); see Engine.
    decode_steps: int = field(16, min=1)
    prefill_buckets: tuple = field((16, 32), ascending=True)
    temperature: float = field(1.0, gt=0)
    top_k: int = field(0, min=0)  # 0: off
    top_p: float = field(1.0, gt=0, le=1)  # 1.0: off
    eos_id: int = 1  # -1: no stop token, responses run to max_decode_len (benchmarks)
    pad_id: int = 0
    # KV memory: "paged" (a pool of pages shared by the slots, used as contexts grow)
    # or "dense" (every slot reserves cache_length positions).
    kv_cache: str = field("paged", choices=KV_CACHES)
    page_size: int = field(16, min=1)
    # Pages in a slice's pool; 0: as many as the dense cache would hold
    # (slots_per_slice x pages_per_slot). Fewer bound memory, more slots use it.
    kv_pages: int = field(0, min=0)
    # auto: the Pallas kernel on TPU; elsewhere the mapped pages gathered, or a full
    # default pool (kv_pages=0) read in place (model/paged_attention.py).
    paged_attention: str = field("auto", choices=PAGED_ATTENTION_IMPLS)
    # V: policy versions a slice holds at once, each slot decoding its own request's
    # version (with LoRA: adapter sets on one base). 1: a slice holds one version and
    # switches only once empty. V > 1 is modelled by the scheduler and the simulator;
    # the runtime's slices hold one version (validation refuses V > 1 for a run).
    versions_per_slice: int = field(1, min=1)
    # Multi-turn episodes a slice holds at once. An episode gives up its slot while its
    # environment answers, so more episodes than slots keep the slots decoding during
    # slow tool calls; the KV of one at its environment is kept off the pool (device
    # or host: `episode_kv`). 0: one per slot (a slot idles through its episode's calls).
    max_episodes_per_slice: int = field(0, min=0)
    # Where an episode's KV waits during its environment call: "device" (fast to
    # resume, device memory outside the page pool) or "host" (copied out and back).
    episode_kv: str = field("device", choices=("device", "host"))
    # Episodes whose observations arrive together are prefilled in one batched call
    # (Engine.prefill_continuations; its shapes compile as they first occur). Off:
    # one prefill each.
    batch_observations: bool = False

    @property
    def samples_per_slice(self) -> int:
        """Requests a slice holds at once: its slots, or `max_episodes_per_slice`."""
        return self.max_episodes_per_slice or self.slots_per_slice

    @property
    def cache_length(self) -> int:
        return self.max_prefill_length + self.max_decode_len

    @property
    def pages_per_slot(self) -> int:
        return -(-self.cache_length // self.page_size)

    @property
    def pool_pages(self) -> int:
        """Usable pages of a slice's paged pool."""
        return self.kv_pages or self.slots_per_slice * self.pages_per_slot

    def __post_init__(self):
        super().__post_init__()
        if self.prefill_buckets[-1] < self.max_prefill_length:
            fail(self._f("prefill_buckets"), f"largest bucket {self.prefill_buckets[-1]} < "
                 f"rollout.max_prefill_length {self.max_prefill_length}")
        if 0 < self.max_episodes_per_slice < self.slots_per_slice:
            fail(self._f("max_episodes_per_slice"), f"{self.max_episodes_per_slice} < "
                 f"rollout.slots_per_slice {self.slots_per_slice}: a slice holds at least one "
                 f"request per slot (0: exactly one)")
        if self.kv_pages and self.kv_pages < self.pages_per_slot:
            fail(self._f("kv_pages"), f"{self.kv_pages} pages cannot hold one request of "
                                      f"cache_length {self.cache_length} ({self.pages_per_slot} "
                                      f"pages of {self.page_size})")


@dataclasses.dataclass(frozen=True)
class TrainerConfig(Section):
    """Optimiser, RL objective and batching of the train step."""

    PATH: ClassVar[str] = "trainer"
    learning_rate: float = field(1e-3, gt=0)
    warmup_steps: int = field(0, min=0)
    schedule: str = field("constant", choices=SCHEDULES)
    decay_steps: int = 1000  # cosine horizon in optimizer updates
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    grad_clip: float = 1.0
    micro_batches: int = field(1, min=1)  # gradient accumulation inside one update
    num_minibatches: int = field(1, min=1)  # optimizer updates per train step
    advantage: str = field("grpo", choices=ADVANTAGES)
    # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    # (verl's: sum of every sequence's token sum / max_decode_len) |
    # seq-mean-token-sum-over-max-len (Dr. GRPO: mean over sequences of token sum /
    # max_decode_len). See rl/losses.py: aggregate_loss.
    loss_agg_mode: str = field("token-mean", choices=LOSS_AGG_MODES)
    # behaviour_clip: ratio pi/mu clipped (mu: the sampling policy); decoupled: ratio
    # pi/pi_prox clipped, weighted by pi_prox/mu (is_mode: truncate at is_cap or mask
    # beyond it); tis: the same with truncation (verl's TIS). pi_prox: the policy at
    # the start of the step. See rl/objective.py.
    objective: str = field("behaviour_clip", choices=OBJECTIVES)
    is_cap: float | None = field(None, gt=0)
    is_mode: str = field("truncate", choices=IS_MODES)
    clip_low: float = field(0.2, ge=0, lt=1)
    clip_high: float = field(0.2, ge=0)
    dual_clip: float | None = field(None, gt=1)
    kl_coef: float = field(0.0, ge=0)
    kl_kind: str = field("k3", choices=KL_KINDS)
    # DAPO: drop groups whose rewards are all equal (ledger `filter` events; the
    # step still trains train_batch_size groups), the soft overlong punishment
    # (0 up to max_decode_len - overlong_buffer tokens, then down to -overlong_penalty)
    # and overlong filtering (no loss on responses cut at max_decode_len).
    filter_zero_variance: bool = False
    overlong_buffer: int = field(0, min=0)
    overlong_penalty: float = field(1.0, ge=0)
    mask_truncated: bool = False
    # Padded prompt + response lengths of train batches (the largest: a whole one).
    length_buckets: tuple = field((32, 64), ascending=True)
    # > 0: pack samples whole into rows of the batch's length bucket and cut
    # micro-batches by this many tokens (rl/packing.py), so one long response no longer
    # pads every row of its batch; micro_batches must be 1. 0: one padded row per
    # sample, micro-batches by row count.
    tokens_per_microbatch: int = field(0, min=0)
    # MoE: "recompute" routes every token by this policy's router; "replay" sends each
    # response token to the experts its rollout recorded (gated by this router), in
    # every forward of the step (policy, pi_prox, reference); tokens without a record
    # (prompts, observations, a response's last token) recompute. See rl/trainer.py.
    moe_routing: str = field("recompute", choices=MOE_ROUTING)

    def __post_init__(self):
        super().__post_init__()
        if self.objective == "behaviour_clip" and self.is_cap is not None:
            fail(self._f("is_cap"), "applies to objective 'decoupled' or 'tis' (behaviour_clip "
                                     "clips pi/mu itself), got objective 'behaviour_clip'")
        if self.objective == "tis" and (self.is_cap is None or self.is_mode != "truncate"):
            fail(self._f("is_cap"), "objective 'tis' truncates the weight: it needs is_cap and "
                                     f"is_mode 'truncate' (got {self.is_cap}, {self.is_mode!r})")


@dataclasses.dataclass(frozen=True)
class CoordinatorConfig(Section):
    """Scheduling: which mode, batch sizes in groups, staleness bound, run length."""

    PATH: ClassVar[str] = "coordinator"
    mode: str = field("dora", choices=MODES)
    group_size: int = field(4, min=1)  # G samples per prompt
    train_batch_size: int = field(4, min=1)  # TBS groups per train step
    # RBS: admitted-but-unconsumed groups; the streaming modes (dora, partial_rollout)
    # count RBS x G samples in flight instead (scheduler/dora.py).
    rollout_batch_size: int = field(8, min=1)
    max_staleness: int = field(2, min=0)  # K
    num_steps: int = field(20, min=1)
    # Train steps between checkpoints (0: only at the end). A crash loses at most
    # this many steps. Orbax writes in the background, but each save holds the
    # coordinator between two steps while it starts (tiny CPU config: ~2 s for the
    # first save in a process, ~0.13 s after); benchmarks turn periodic saves off.
    checkpoint_every: int = field(5, min=0)
    # A periodic save is skipped while fewer than this many seconds have passed since
    # the last one began (0: never skipped), so that with fast steps the saves' own
    # cost stays a small share of the run (on a CPU host each costs about 0.1 s of
    # the run's time: docs/checkpoints.md). A crash then loses at most this long
    # beyond `checkpoint_every` steps. The save at the end is always taken.
    checkpoint_min_seconds: float = field(0.0, ge=0)
    # Where checkpoints go ("": <workdir>/checkpoints). A gs:// location lets Orbax
    # write straight to Cloud Storage (under Pathways, from the TPU hosts) while the
    # workdir's other files stay on a mounted bucket (dora_jax.launch.gke sets it).
    checkpoint_dir: str = field("")
    # A slice that raises is restarted empty (its requests regenerated) up to this
    # many times in a run; one more failure stops the run.
    max_slice_restarts: int = field(3, min=0)
    # Seconds without any event while work is outstanding (a sample running, a load,
    # a train step, rewards pending) after which the run stops with a RunError naming
    # what each slice and the trainer were doing (0: wait forever). Far above any
    # single generate call, load or train step.
    stall_timeout: float = field(600.0, ge=0)
    # Fault injection (tests, drills), by count, not by timing: slice `fail_slice`
    # (-1: none; -2: whichever slice gets there first) raises the (`fail_after` +
    # 1)-th time it reaches `fail_point`:
    # "generate" (a generate call with requests held), "load" (placing a version's
    # params), "export" (a migration out, its hand-over not yet filled) or "import"
    # (a migration in, its requests arrived). The restarted slice does not fail again.
    fail_slice: int = field(FAIL_NO_SLICE, min=FAIL_ANY_SLICE)
    fail_point: str = field("generate", choices=FAIL_POINTS)
    fail_after: int = field(0, min=0)
    # The same for the whole process (runtime/faults.py KillPlan): SIGKILL the
    # (`kill_after` + 1)-th time the run reaches `kill_point` ("": never; "train": a
    # step begun; "save": a checkpoint being written; "finished_waiting": finished
    # groups waiting on a busy trainer; "at_environment": samples just finished while
    # four or more episodes wait for their environments). The same command then
    # resumes the run.
    kill_point: str = field(KILL_NEVER, choices=KILL_POINTS)
    kill_after: int = field(0, min=0)
    # Rewards run in this many worker processes, never in the coordinator's
    # (rewards/pool.py): model text is untrusted input.
    reward_workers: int = field(2, min=1)
    # Seconds a reward call may run (0: no limit); past it the worker is killed and
    # replaced, the sample scores 0 with the reason in the ledger, and the run goes on.
    reward_timeout: float = field(60.0, ge=0)
    # MiB each reward worker may grow beyond its loaded modules (0: no cap); a call
    # past it scores 0 with the reason.
    reward_memory_mb: int = field(2048, min=0)
    # Longest response scored, in characters of text or ids of a token response; a
    # longer one scores 0 with the reason, before any parsing.
    reward_max_response: int = field(1 << 20, min=1)

    def __post_init__(self):
        check_not_retired(self.mode)
        super().__post_init__()
        check_rollout_batch(self.rollout_batch_size, self.train_batch_size)


def check_rollout_batch(rollout_batch_size: int, train_batch_size: int) -> None:
    """RBS >= TBS: the rollout must hold at least one train batch."""
    if rollout_batch_size < train_batch_size:
        fail("coordinator.rollout_batch_size", f"must be >= coordinator.train_batch_size "
              f"({train_batch_size}), got {rollout_batch_size}")
