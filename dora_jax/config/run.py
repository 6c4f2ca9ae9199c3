"""The whole run config: every section, checked together by the rules that span them
(`RULES`, below: one small function each, run in order, the first broken one failing,
naming its field) once each section has checked its own. The rules on a schedule's
shape take plain values (rules.py), shared with the scheduler's own config."""

from __future__ import annotations

import dataclasses
import math

from .data import DataConfig
from .model import MeshConfig, ModelConfig, _axes_of
from .modes import CAPABILITIES, modes_with
from .report import EvalConfig, LoggingConfig
from .rules import check_group_fits, check_multi_version, check_versions
from .schema import Section, fail
from .sections import (
    FAIL_ANY_SLICE,
    FAIL_NO_SLICE,
    CoordinatorConfig,
    RolloutConfig,
    TrainerConfig,
    gpu_paged_blocks,
)


@dataclasses.dataclass(frozen=True)
class Config(Section):
    model: ModelConfig
    mesh: MeshConfig
    rollout: RolloutConfig = RolloutConfig()
    trainer: TrainerConfig = TrainerConfig()
    coordinator: CoordinatorConfig = CoordinatorConfig()
    data: DataConfig = DataConfig()
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()
    seed: int = 0
    init_checkpoint: str = ""  # params to start from (e.g. dora_jax.sft's checkpoints/)

    def __post_init__(self):
        """Every check that spans sections (`RULES`), in order."""
        for rule in RULES:
            rule(self)


# The rules of a whole config, in the order `Config` runs them.

def mesh_axes_divide_their_dims(cfg: Config) -> None:
    m, mesh = cfg.model, cfg.mesh
    for (name, axis), (what, dim) in [
            (("trainer", "tensor"), ("model.num_kv_heads", m.num_kv_heads)),
            (("slice", "tensor"), ("model.num_kv_heads", m.num_kv_heads)),
            (("trainer", "expert"), ("model.moe.num_experts", m.moe.num_experts)),
            (("slice", "expert"), ("model.moe.num_experts", m.moe.num_experts))]:
        size = getattr(mesh, name)[axis]
        if size > 1 and dim and dim % size:
            fail(f"mesh.{name}.{axis}", f"mesh axis size {size} must divide {what} ({dim})")


def top_k_within_vocab(cfg: Config) -> None:
    r, m = cfg.rollout, cfg.model
    if r.top_k > m.vocab_size:
        fail("rollout.top_k", f"must be in [0, vocab_size={m.vocab_size}], got {r.top_k}")


def special_ids_within_vocab(cfg: Config) -> None:
    for name in ("eos_id", "pad_id"):
        value = getattr(cfg.rollout, name)
        if name == "eos_id" and value == -1:  # no stop token
            continue
        if not 0 <= value < cfg.model.vocab_size:
            fail(f"rollout.{name}", f"must be a token id < vocab_size ({cfg.model.vocab_size})"
                 + (" or -1 (no stop token)" if name == "eos_id" else ""))


def filtering_needs_replacement(cfg: Config) -> None:
    mode = cfg.coordinator.mode
    if cfg.trainer.filter_zero_variance and not CAPABILITIES[mode].replaces_filtered_groups:
        fail("trainer.filter_zero_variance", f"{mode} trains fixed batches of group "
              "ids and cannot replace a filtered group; use "
              + modes_with("replaces_filtered_groups"))


def overlong_buffer_within_decode(cfg: Config) -> None:
    t, r = cfg.trainer, cfg.rollout
    if t.overlong_buffer >= r.max_decode_len:
        fail("trainer.overlong_buffer", f"must be < rollout.max_decode_len "
              f"({r.max_decode_len}), got {t.overlong_buffer}")


def length_buckets_hold_a_trajectory(cfg: Config) -> None:
    t, r = cfg.trainer, cfg.rollout
    if t.length_buckets[-1] < r.cache_length:
        fail("trainer.length_buckets",
              f"largest bucket {t.length_buckets[-1]} must hold a whole trajectory "
              f"(rollout.max_prefill_length + rollout.max_decode_len = {r.cache_length})")


def colocation_needs_turns(cfg: Config) -> None:
    mode = cfg.coordinator.mode
    if cfg.mesh.colocated and not CAPABILITIES[mode].allows_colocation:
        turns = modes_with("allows_colocation")
        fail("mesh.colocated", "slices share the trainer's devices only in a mode that "
              f"takes turns between rollout and training ({turns}), not in {mode!r}")


def group_fits_the_slots(cfg: Config) -> None:
    check_group_fits(cfg.coordinator.group_size, cfg.mesh.num_slices,
                     cfg.rollout.slots_per_slice)


def versions_fit_the_window(cfg: Config) -> None:
    check_versions(cfg.rollout.versions_per_slice, cfg.coordinator.max_staleness)


def multi_version_slices_share_a_base(cfg: Config) -> None:
    if cfg.rollout.versions_per_slice > 1:
        check_multi_version(cfg.rollout.versions_per_slice, cfg.coordinator.mode, cfg.model)


def whole_responses_are_scored(cfg: Config) -> None:
    c, r = cfg.coordinator, cfg.rollout
    if c.reward_max_response < r.max_decode_len:
        fail("coordinator.reward_max_response", f"must be >= rollout.max_decode_len "
              f"({r.max_decode_len}): a complete response must be scored, got "
              f"{c.reward_max_response}")


def eval_is_single_turn(cfg: Config) -> None:
    if cfg.eval.every and cfg.data.source == "env":
        fail("eval.every", "held-out evaluation runs single-turn prompts; multi-turn "
             "episodes (data.source='env') report their rewards in the ledger and "
             "metrics instead: set eval.every=0")


def eval_slice_exists(cfg: Config) -> None:
    n = cfg.mesh.num_slices
    if cfg.eval.every and cfg.eval.slice >= n:
        fail("eval.slice", f"must name a slice < mesh.num_slices ({n}), got {cfg.eval.slice}")


def fail_slice_exists(cfg: Config) -> None:
    n, fail_slice = cfg.mesh.num_slices, cfg.coordinator.fail_slice
    if fail_slice >= n:
        fail("coordinator.fail_slice", f"must name a slice < mesh.num_slices "
              f"({n}), or be {FAIL_NO_SLICE} (none) or {FAIL_ANY_SLICE} (any), "
              f"got {fail_slice}")


def _samples_split(cfg: Config) -> tuple[int, int]:
    """A train step's samples, and the micro-batches x minibatches it is cut into."""
    c, t = cfg.coordinator, cfg.trainer
    return c.train_batch_size * c.group_size, t.micro_batches * t.num_minibatches


def _batch_shards(cfg: Config) -> tuple[tuple, int]:
    """The trainer mesh's axes the batch is sharded over, and their size."""
    batch_axes = _axes_of(dict(cfg.mesh.trainer_rules).get("batch"))
    return batch_axes, math.prod(cfg.mesh.trainer[a] for a in batch_axes)


def batch_splits_evenly(cfg: Config) -> None:
    samples, split = _samples_split(cfg)
    if samples % split:
        fail("coordinator.train_batch_size",
              f"TBS x group_size = {samples} samples must divide evenly into "
              f"trainer.num_minibatches x trainer.micro_batches = {split}")


def packed_microbatches_fill_the_shards(cfg: Config) -> None:
    t = cfg.trainer
    if not t.tokens_per_microbatch:
        return
    batch_axes, shards = _batch_shards(cfg)
    row = t.length_buckets[-1]
    if t.micro_batches != 1:
        fail("trainer.micro_batches", "must be 1 with trainer.tokens_per_microbatch "
              f"(micro-batches are cut by tokens then), got {t.micro_batches}")
    rows = t.tokens_per_microbatch // row
    if rows < 1 or t.tokens_per_microbatch % (row * shards):
        fail("trainer.tokens_per_microbatch", f"must be a positive multiple of the "
              f"packed row ({row} tokens: the largest trainer.length_buckets) x the "
              f"trainer mesh's {shards} batch shards {batch_axes} = {row * shards}, "
              f"got {t.tokens_per_microbatch}")


def padded_microbatches_fill_the_shards(cfg: Config) -> None:
    if cfg.trainer.tokens_per_microbatch:
        return
    (samples, split), (batch_axes, shards) = _samples_split(cfg), _batch_shards(cfg)
    if (samples // split) % shards:
        fail("coordinator.train_batch_size", f"TBS x group_size = {samples} samples in "
              f"{split} micro-batches must divide by the trainer mesh's {shards} batch "
              f"shards {batch_axes}")


def oversubscription_needs_episodes(cfg: Config) -> None:
    r = cfg.rollout
    if r.max_episodes_per_slice and cfg.data.source != "env":
        # A single-turn request holds its slot to the end: more of them than slots
        # would only queue inside the slice, out of the scheduler's sight.
        fail("rollout.max_episodes_per_slice", f"{r.max_episodes_per_slice} episodes per "
             f"slice needs multi-turn episodes (data.source='env'), got data.source="
             f"{cfg.data.source!r}; leave it 0")


def replay_needs_experts(cfg: Config) -> None:
    if cfg.trainer.moe_routing == "replay" and not cfg.model.moe.enabled:
        fail("trainer.moe_routing", "'replay' sends tokens to recorded experts: it needs an "
             "MoE model (model.moe.num_experts > 0), got a dense one")


def token_tasks_have_no_tokenizer(cfg: Config) -> None:
    d = cfg.data
    if d.source in ("residue", "countdown") and d.tokenizer:
        # Their prompts and rewards are token ids with EOS 1 and PAD 0 (rewards/tokens.py),
        # which mean nothing to a real tokenizer's model.
        fail("data.source", f"{d.source!r} is a token task (EOS id 1), but data.tokenizer "
              f"{d.tokenizer} is set (by model.checkpoint or data.tokenizer): use a text "
              "source, e.g. --config.data.source=gsm8k --config.data.path=FILE")


def gpu_kernel_tiles_the_pages(cfg: Config) -> None:
    r = cfg.rollout
    if r.kv_cache == "paged" and r.paged_attention == "pallas_gpu":
        gpu_paged_blocks(r.pages_per_slot, r.page_size, cfg.model.head_dim)


def residue_prompts_fit(cfg: Config) -> None:
    d = cfg.data
    if d.source == "residue" and d.prompt_len > cfg.rollout.max_prefill_length:
        fail("data.prompt_len", f"must be <= rollout.max_prefill_length, got {d.prompt_len}")


def residue_modulus_within_vocab(cfg: Config) -> None:
    d = cfg.data
    if d.source == "residue" and d.modulus > cfg.model.vocab_size - 3:
        fail("data.modulus", f"must be in [2, vocab_size - 3], got {d.modulus}")


def countdown_fits(cfg: Config) -> None:
    d, r, m = cfg.data, cfg.rollout, cfg.model
    if d.source == "countdown" and not d.max_count < min(r.max_decode_len, m.vocab_size - 3):
        fail("data.max_count", f"must be < rollout.max_decode_len and vocab_size - 3 (a "
              f"countdown is max_count + 1 tokens of numbers 0..), got {d.max_count}")


RULES = (mesh_axes_divide_their_dims, top_k_within_vocab, special_ids_within_vocab,
         filtering_needs_replacement, overlong_buffer_within_decode,
         length_buckets_hold_a_trajectory, colocation_needs_turns, group_fits_the_slots,
         versions_fit_the_window, multi_version_slices_share_a_base,
         whole_responses_are_scored, eval_is_single_turn, eval_slice_exists,
         fail_slice_exists, batch_splits_evenly, packed_microbatches_fill_the_shards,
         padded_microbatches_fill_the_shards, replay_needs_experts,
         oversubscription_needs_episodes, gpu_kernel_tiles_the_pages,
         token_tasks_have_no_tokenizer,
         residue_prompts_fit, residue_modulus_within_vocab, countdown_fits)
