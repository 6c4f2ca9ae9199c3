"""What `cfg.data` names, built: the tokenizer, the prompt records (less those held
out for evaluation), the reward function and the demonstrations a supervised warm
start imitates.

Token tasks (residue, countdown, JSONL of token ids) need no tokenizer. Text tasks
(GSM8K / MATH JSONL, reasoning_gym, a prepared TFDS dataset) build each prompt with
the tokenizer's chat template and score the decoded response with a verifier
(rewards/verifiers.py); a reward call that raises or times out is recorded, never
fatal (rewards/pool.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dora_jax.config import TEXT_REWARDS, Config
from dora_jax.data import prompts, tasks
from dora_jax.rewards import tokens
from dora_jax.rewards.tokens import RewardFn


class _WithTemplateArgs:
    """A tokenizer whose chat template always gets `data.chat_template_args`."""

    def __init__(self, tokenizer, template_args: dict):
        self._tokenizer, self._args = tokenizer, dict(template_args)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def apply_chat_template(self, messages, **kwargs):
        return self._tokenizer.apply_chat_template(messages, **{**self._args, **kwargs})


def tokenizer_for(cfg: Config):
    """The run's `data.tokenizer.Tokenizer`, or None for token tasks without one."""
    if not cfg.data.tokenizer:
        return None
    from dora_jax.text.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(cfg.data.tokenizer)


def _text_records(cfg: Config, tokenizer) -> list[dict]:
    from dora_jax.data import text_tasks

    d = cfg.data
    tok = _WithTemplateArgs(tokenizer, d.chat_template_args)
    common = dict(instruction=d.instruction, system_prompt=d.system_prompt or None,
                  vocab_size=cfg.model.vocab_size)
    if d.source == "gsm8k":
        return text_tasks.gsm8k_records(d.path, tok, **common)
    if d.source == "math":
        return text_tasks.math_records(d.path, tok, **common)
    if d.source == "reasoning_gym":
        return text_tasks.reasoning_gym_records(d.task, tok, size=d.num_prompts, seed=cfg.seed,
                                                config=dict(d.task_args), **common)
    if d.source == "env":
        return _env_records(cfg, tok)
    from dora_jax.data import tfds_local

    source = tfds_local.tfds_records(d.tfds_name, d.tfds_split, d.tfds_dir or None, tok,
                                     **common)
    # Records are needed whole (prompt lengths checked, resumable stream over a list).
    records = [source[i] for i in range(len(source))]
    prompts.check_unique(records, [f"{d.tfds_name}/{d.tfds_split}[{i}]"
                                   for i in range(len(records))])
    return records


def _env_records(cfg: Config, tokenizer) -> list[dict]:
    """A multi-turn environment's task records, each prompt the chat turn of its
    first observation (`reset`); `env` names the environment in every record."""
    from dora_jax.data.text_tasks import chat_tokens
    from dora_jax.envs import base

    d = cfg.data
    try:
        env_cls = base.get(d.env)
    except ValueError as e:
        raise prompts.DataError(f"data.env: {e}") from None
    records = []
    for record in env_cls.records(d.num_prompts, cfg.seed):
        first = env_cls().reset(record)
        tokens = chat_tokens(tokenizer, first, system_prompt=d.system_prompt or None)
        records.append(prompts.check_record(dict(record, tokens=tokens, env=d.env),
                                            record["prompt_id"], cfg.model.vocab_size))
    return records


def all_prompt_records(cfg: Config, tokenizer=None) -> list[dict]:
    """Every prompt record of the source, before the length filter; no two share a
    prompt_id (a DataError names both; file sources name their lines)."""
    records = _records_of_source(cfg, tokenizer)
    # Each file source already refused repeats naming file:line; this covers the rest.
    prompts.check_unique(records)
    return records


def _records_of_source(cfg: Config, tokenizer) -> list[dict]:
    d, vocab = cfg.data, cfg.model.vocab_size
    if d.source == "residue":
        return prompts.in_memory(tasks.residue_prompts(
            d.num_prompts, vocab, prompt_len=d.prompt_len, modulus=d.modulus, seed=cfg.seed),
            vocab)
    if d.source == "countdown":
        return prompts.in_memory(tasks.countdown_prompts(
            d.num_prompts, vocab, median=d.count_median, sigma=d.count_sigma,
            max_count=d.max_count, seed=cfg.seed), vocab)
    tokenizer = tokenizer or tokenizer_for(cfg)
    if d.source == "jsonl":
        return prompts.read_jsonl(d.path, None if tokenizer is None else tokenizer.encode,
                                  vocab_size=vocab)
    return _text_records(cfg, tokenizer)


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
    applied to the decoded response). An unknown name fails here, before compute."""
    name = cfg.data.reward_name
    if name == "env":
        return _scored_by_environment
    if name not in TEXT_REWARDS:
        return tokens.reward_fn(name)
    from dora_jax.rewards import verifiers

    return verifiers.token_reward(verifiers.text_reward(name), tokenizer or tokenizer_for(cfg))


def _scored_by_environment(record, response) -> float:
    raise RuntimeError("a multi-turn episode is scored by its environment, not the "
                       "reward pool")


def demonstration_for(cfg: Config, tokenizer=None) -> Callable[[dict], list]:
    """A record's correct response as token ids (what supervised warm starts imitate):
    the task's own for token tasks, else the record's `demonstration` text or its
    answer in the format the prompt asks for, then EOS. A multi-turn environment's
    demonstration is a whole episode: {"response_tokens", "episode"} (its turns,
    so that the observations carry no loss)."""
    if cfg.data.source == "env":
        from dora_jax.envs import base
        from dora_jax.rollout.episodes import demonstration_tokens, observation_frame

        env_cls, tokenizer = base.get(cfg.data.env), tokenizer or tokenizer_for(cfg)
        frame = observation_frame(tokenizer)  # once, not per demonstration
        return lambda record: demonstration_tokens(env_cls, record, tokenizer, frame)
    if cfg.data.reward_name not in TEXT_REWARDS:
        return tasks.demonstration_fn(cfg.data.reward_name)
    from dora_jax.data.text_tasks import ANSWER_FORMATS

    tokenizer = tokenizer or tokenizer_for(cfg)

    def demonstrate(record: dict) -> list:
        text = record.get("demonstration")
        if text is None:
            if record.get("answer") is None:
                raise prompts.DataError(f"{record['prompt_id']}: no answer to imitate")
            text = ANSWER_FORMATS[record["verifier"]].format(record["answer"])
        return tokenizer.encode(text) + [tokenizer.eos_id]

    return demonstrate
