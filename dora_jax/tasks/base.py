"""What a task is, and tasks by name (`data.source=name`).

A task is what the model is asked and how its answer is scored: its prompt records,
its reward, the demonstrations a supervised warm start imitates, and the facts about
it that config validation checks (`text`, `needs`, `reward`), declared to config on
registering (config sits below this package and lists the shipped tasks itself).
Every module of this package is a task's and is imported on the first lookup: a new
task is one file here, or in a module the run's config imports.

A task's reward and demonstrations default to those of `data.reward` by name (a
run may score a task's records with another reward than its own); a task that
scores otherwise (a multi-turn environment) overrides them.
"""

from __future__ import annotations

import importlib
import pathlib
import pkgutil
from collections.abc import Callable
from typing import Any, ClassVar

from dora_jax import config
from dora_jax.data import prompts
from dora_jax.rewards import tokens
from dora_jax.rewards.tokens import RewardFn

_TASKS: dict[str, Task] = {}


class Task:
    """One task; subclass, set the class attributes and `records`, and `register`."""

    name: ClassVar[str]
    # config.TaskFacts: the reward `data.reward="auto"` means; whether its prompts are
    # built with a tokenizer's chat template; the data field that names its prompts.
    reward: ClassVar[str]
    text: ClassVar[bool] = False
    needs: ClassVar[str] = ""

    def records(self, cfg, tokenizer=None) -> list[dict]:
        """Every prompt record, before the length filter."""
        raise NotImplementedError

    def reward_fn(self, cfg, tokenizer=None) -> RewardFn:
        """The reward the reward pool scores a response with."""
        return reward_by_name(cfg, tokenizer)

    def demonstration_fn(self, cfg, tokenizer=None) -> Callable[[dict], Any]:
        """A record's correct response as token ids, for a supervised warm start."""
        return demonstration_by_reward(cfg, tokenizer)


def register(cls: type[Task]) -> type[Task]:
    """Class decorator: the task is `data.source=cls.name`."""
    if cls.name in _TASKS and type(_TASKS[cls.name]) is not cls:
        raise ValueError(f"task {cls.name!r} is registered twice")
    config.declare_task(cls.name, config.TaskFacts(cls.reward, cls.text, cls.needs))
    _TASKS[cls.name] = cls()
    return cls


def unregister(name: str) -> None:
    """Forgets task `name` (tests register throwaway tasks)."""
    _TASKS.pop(name, None)
    config.forget_task(name)


def names() -> tuple:
    """Every registered task's name."""
    _load_builtins()
    return tuple(sorted(_TASKS))


def get(name: str) -> Task:
    """The task registered as `name` (ValueError naming the choices)."""
    _load_builtins()
    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; registered: {sorted(_TASKS)}")
    return _TASKS[name]


def _load_builtins() -> None:
    """Imports every module of this package: each registers its tasks."""
    package = pathlib.Path(__file__).parent
    for info in pkgutil.iter_modules([str(package)]):
        if info.name not in ("base", "sources"):
            importlib.import_module(f"dora_jax.tasks.{info.name}")


def tokenizer_for(cfg):
    """The run's `text.tokenizer.Tokenizer`, or None for token tasks without one."""
    if not cfg.data.tokenizer:
        return None
    from dora_jax.text.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(cfg.data.tokenizer)


class _WithTemplateArgs:
    """A tokenizer whose chat template always gets `data.chat_template_args`."""

    def __init__(self, tokenizer, template_args: dict):
        self._tokenizer, self._args = tokenizer, dict(template_args)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def apply_chat_template(self, messages, **kwargs):
        return self._tokenizer.apply_chat_template(messages, **{**self._args, **kwargs})


def chat_tokenizer(cfg, tokenizer):
    """The tokenizer a text task builds its prompts with: the run's, its chat
    template given `data.chat_template_args`."""
    return _WithTemplateArgs(tokenizer or tokenizer_for(cfg), cfg.data.chat_template_args)


def text_options(cfg) -> dict:
    """What every text task's records take from the config (text_records.make_record)."""
    d = cfg.data
    return dict(instruction=d.instruction, system_prompt=d.system_prompt or None,
                vocab_size=cfg.model.vocab_size)


def reward_by_name(cfg, tokenizer=None) -> RewardFn:
    """The reward `data.reward` names: of response tokens, or a text verifier applied
    to the decoded response. An unknown name fails here, before compute."""
    from dora_jax.config import TEXT_REWARDS

    name = cfg.data.reward_name
    if name not in TEXT_REWARDS:
        return tokens.reward_fn(name)
    from dora_jax.rewards import verifiers

    return verifiers.token_reward(verifiers.text_reward(name), tokenizer or tokenizer_for(cfg))


# The correct response of a record, by reward name, for the token rewards with one.
TOKEN_DEMONSTRATIONS: dict[str, Callable[[dict], list]] = {
    "countdown": tokens.countdown_target}


def demonstration_by_reward(cfg, tokenizer=None) -> Callable[[dict], list]:
    """The correct response of a record as the reward `data.reward` names scores it:
    a token task's own, else the record's `demonstration` text or its answer in the
    format the prompt asks for, then EOS."""
    from dora_jax.config import TEXT_REWARDS

    name = cfg.data.reward_name
    if name not in TEXT_REWARDS:
        if name not in TOKEN_DEMONSTRATIONS:
            raise ValueError(f"task {name!r} has no demonstrations to imitate; tasks with "
                             f"them: {sorted(TOKEN_DEMONSTRATIONS)}")
        return TOKEN_DEMONSTRATIONS[name]
    from dora_jax.data.text_records import ANSWER_FORMATS

    tokenizer = tokenizer or tokenizer_for(cfg)

    def demonstrate(record: dict) -> list:
        text = record.get("demonstration")
        if text is None:
            if record.get("answer") is None:
                raise prompts.DataError(f"{record['prompt_id']}: no answer to imitate")
            text = ANSWER_FORMATS[record["verifier"]].format(record["answer"])
        return tokenizer.encode(text) + [tokenizer.eos_id]

    return demonstrate
