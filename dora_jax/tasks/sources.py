"""What `cfg.data` names, built: the tokenizer, the prompt records (less those held
out for evaluation), the reward function and the demonstrations a supervised warm
start imitates.

Each comes from the task `data.source` names (dora_jax/tasks: token tasks need no
tokenizer; text tasks build each prompt with the tokenizer's chat template and score
the decoded response with a verifier, rewards/verifiers.py); a reward call that
raises or times out is recorded, never fatal (rewards/pool.py). This module sits
above the task modules: it is what the runtime, the warm start and the benchmarks call.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

import numpy as np

from dora_jax import tasks
from dora_jax.config import Config, fail
from dora_jax.data import prompts
from dora_jax.rewards.tokens import RewardFn
from dora_jax.tasks.base import tokenizer_for

__all__ = ["all_prompt_records", "demonstration_for", "held_out_split", "prompt_records",
           "reward_for", "tokenizer_for"]


def all_prompt_records(cfg: Config, tokenizer=None) -> list[dict]:
    """Every prompt record of the source, before the length filter; no two share a
    prompt_id (a DataError names both; file sources name their lines)."""
    records = tasks.get(cfg.data.source).records(cfg, tokenizer)
    # Each file source already refused repeats naming file:line; this covers the rest.
    prompts.check_unique(records)
    return records


def prompt_records(cfg: Config, tokenizer=None) -> tuple[list[dict], list[str]]:
    """(the records a run draws from, the ids left out for their length).

    A prompt longer than rollout.max_prefill_length is an error naming it, unless
    data.skip_long_prompts, which leaves it out (the run writes a ledger `filter`
    line for each)."""
    records = all_prompt_records(cfg, tokenizer)
    limit = cfg.rollout.max_prefill_length
    too_long = [r["prompt_id"] for r in records if len(r["tokens"]) > limit]
    if too_long and not cfg.data.skip_long_prompts:
        longest = max(len(r["tokens"]) for r in records)
        raise prompts.DataError(
            f"{len(too_long)} prompt(s) longer than rollout.max_prefill_length={limit} "
            f"(longest: {longest} tokens), e.g. {too_long[:3]} (data.skip_long_prompts "
            "skips them, each with a ledger `filter` line)")
    skipped = set(too_long)
    return [r for r in records if r["prompt_id"] not in skipped], too_long


def held_out_split(records: list[dict], cfg: Config) -> tuple[list[dict], list[dict]]:
    """(the records training draws from, the `eval.num_prompts` held out for
    evaluation during training). The held-out ones are drawn by the run seed, so a
    resumed run holds out the same; the rest keep their order. Without `eval.every`
    nothing is held out."""
    if not cfg.eval.every:
        return records, []
    n = cfg.eval.num_prompts
    if n >= len(records):
        raise prompts.DataError(f"eval.num_prompts={n} would hold out every one of the "
                                f"{len(records)} prompt(s) training could draw from")
    chosen = set(np.random.default_rng([cfg.seed, 0xE7A1]).permutation(len(records))[:n]
                 .tolist())
    return ([r for i, r in enumerate(records) if i not in chosen],
            [r for i, r in enumerate(records) if i in chosen])


def reward_for(cfg: Config, tokenizer=None) -> RewardFn:
    """The reward function `data.reward` names (token-level, or a text verifier
    applied to the decoded response; a multi-turn episode's is its environment's).
    An unknown name, or a function the reward pool's processes cannot be handed,
    fails here, before compute."""
    fn = tasks.get(cfg.data.source).reward_fn(cfg, tokenizer)
    try:
        pickle.dumps(fn)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        fail("data.source", f"task {cfg.data.source!r}: its reward function goes to the "
             f"reward pool's worker processes and must pickle (a module-level function, "
             f"or functools.partial of one), but: {e}")
    return fn


def demonstration_for(cfg: Config, tokenizer=None) -> Callable[[dict], list]:
    """A record's correct response as token ids (what supervised warm starts imitate):
    the task's own for token tasks, else the record's `demonstration` text or its
    answer in the format the prompt asks for, then EOS. A multi-turn environment's
    demonstration is a whole episode: {"response_tokens", "episode"} (its turns,
    so that the observations carry no loss)."""
    return tasks.get(cfg.data.source).demonstration_fn(cfg, tokenizer)
