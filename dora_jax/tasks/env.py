"""`env`: multi-turn episodes of an environment (`data.env`, by its name in
envs/base.py's registry). A record's prompt is the chat turn of the environment's
first observation (`reset`); the environment scores the episode, so the reward pool
never does; a demonstration is a whole episode."""

from __future__ import annotations

from typing import Any

from dora_jax import envs
from dora_jax.data import prompts
from dora_jax.data.text_records import chat_tokens
from dora_jax.tasks.base import Task, chat_tokenizer, register, tokenizer_for


def environment(cfg) -> Any:
    """The class of the environment `data.env` names; DataError if none is."""
    try:
        return envs.get(cfg.data.env)
    except ValueError as e:
        raise prompts.DataError(f"data.env: {e}") from None


def _scored_by_environment(record, response) -> float:
    raise RuntimeError("a multi-turn episode is scored by its environment, not the "
                       "reward pool")


@register
class Environment(Task):
    name = "env"
    reward = "env"
    text = True
    needs = "env"

    def records(self, cfg, tokenizer=None) -> list[dict]:
        """The environment's task records, `env` naming it in every one."""
        d, tokenizer = cfg.data, chat_tokenizer(cfg, tokenizer)
        env_cls = environment(cfg)
        records = []
        for record in env_cls.records(d.num_prompts, cfg.seed):
            first = env_cls().reset(record)
            tokens = chat_tokens(tokenizer, first, system_prompt=d.system_prompt or None)
            records.append(prompts.check_record(dict(record, tokens=tokens, env=d.env),
                                                record["prompt_id"], cfg.model.vocab_size))
        return records

    def reward_fn(self, cfg, tokenizer=None):
        return _scored_by_environment

    def demonstration_fn(self, cfg, tokenizer=None):
        """{"response_tokens", "episode"}: the episode's tokens and its turns, so that
        the observations carry no loss."""
        # The runner's framing of observations, so a demonstration reads as an episode.
        from dora_jax.rollout.episodes import demonstration_tokens, observation_frame

        env_cls, tokenizer = envs.get(cfg.data.env), tokenizer or tokenizer_for(cfg)
        frame = observation_frame(tokenizer)  # once, not per demonstration
        return lambda record: demonstration_tokens(env_cls, record, tokenizer, frame)
