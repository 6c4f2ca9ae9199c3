"""The data section of the run config: where prompts come from and how they are
scored (re-exported by `dora_jax.config`; no JAX, reads no file)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

from .schema import Section, fail, field
from .vetted_tasks import refusal

# Rewards by name: of response tokens (rewards/tokens.py) and of decoded text
# (rewards/verifiers.py; "by_record": the verifier each record names); "env": a
# multi-turn episode's, the sum of its environment's step rewards.
TOKEN_REWARDS = ("residue", "exact_match", "countdown")
TEXT_REWARDS = ("gsm8k", "math", "countdown_expr", "reasoning_gym", "by_record")


@dataclasses.dataclass(frozen=True)
class TaskFacts:
    """What validation checks of a task: the reward `data.reward="auto"` means, whether
    its prompts are built with a tokenizer's chat template, the data field that must
    name its prompts."""

    auto_reward: str
    text: bool = False
    needs: str = ""


# The shipped tasks, so a config validates without importing dora_jax/tasks, which
# declares each again on registering (`declare_task`), as does any task added there.
TASKS: dict[str, TaskFacts] = {
    "residue": TaskFacts("residue"),
    "countdown": TaskFacts("countdown"),
    "jsonl": TaskFacts("exact_match", needs="path"),
    "gsm8k": TaskFacts("gsm8k", text=True, needs="path"),
    "math": TaskFacts("math", text=True, needs="path"),
    "reasoning_gym": TaskFacts("by_record", text=True, needs="task"),
    "tfds": TaskFacts("by_record", text=True, needs="tfds_name"),
    "env": TaskFacts("env", text=True, needs="env"),
}
SHIPPED_TASKS = tuple(TASKS)


def declare_task(name: str, facts: TaskFacts) -> None:
    """Makes `name` a `data.source` validated by `facts` (tasks.register calls it); a
    shipped task declared with other facts is an error."""
    if TASKS.get(name, facts) != facts:
        raise ValueError(f"task {name!r} declares {facts}, but config has {TASKS[name]}")
    TASKS[name] = facts


def forget_task(name: str) -> None:
    if name not in SHIPPED_TASKS:
        TASKS.pop(name, None)


@dataclasses.dataclass(frozen=True)
class DataConfig(Section):
    """Where prompts come from and how they are scored."""

    PATH: ClassVar[str] = "data"
    source: str = "residue"  # a task's name (TASKS)
    reward: str = field("auto", choices=("auto", "env") + TOKEN_REWARDS + TEXT_REWARDS)
    path: str = ""  # jsonl, gsm8k, math: the JSONL file
    # A Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json);
    # default: model.checkpoint's. Its EOS / pad ids become rollout.eos_id / pad_id.
    tokenizer: str = ""
    # Text prompts: a chat turn of the question plus `instruction` (None: the
    # answer format's own, e.g. "... after ####"), after an optional system prompt;
    # chat_template_args go to the template (e.g. enable_thinking=False for Qwen3).
    instruction: str | None = None
    system_prompt: str = ""
    chat_template_args: Mapping = dataclasses.field(default_factory=dict)
    task: str = ""  # reasoning_gym: the task, e.g. basic_arithmetic, countdown
    task_args: Mapping = dataclasses.field(default_factory=dict)  # its dataset's config
    # tfds: a prepared dataset (python -m dora_jax.data.tfds_local builds one from
    # JSONL), read with tfds.data_source; nothing is downloaded.
    tfds_name: str = ""
    tfds_split: str = "train"
    tfds_dir: str = ""
    num_prompts: int = field(512, min=1)  # synthetic and reasoning_gym tasks
    prompt_len: int = field(6, min=2)  # residue
    modulus: int = field(4, min=2)  # residue
    count_median: float = field(12.0, gt=0)  # countdown: lognormal counts, clipped
    count_sigma: float = field(1.1, ge=0)  # to [1, max_count]
    max_count: int = field(255, min=1)
    num_epochs: int | None = field(None, min=1)  # None: repeat forever
    # Prompts longer than rollout.max_prefill_length (files and datasets): an
    # error, or (True) left out, each with a ledger `filter` line naming it.
    skip_long_prompts: bool = False
    shuffle: bool = True
    # Multi-turn episodes (source "env"): the environment by registered name
    # (dora_jax/envs: calculator, python, guess), its model turns per episode (0: the
    # environment's own limit), seconds per environment call and threads for them
    # per slice. An episode's token budget, model and observation tokens together,
    # is rollout.max_decode_len.
    env: str = ""
    env_max_turns: int = field(0, min=0)
    env_timeout: float = field(30.0, gt=0)
    env_workers: int = field(4, min=1)
    # A delay added to every environment call, for benchmarks of slow tools: seconds,
    # log-normal around the median with shape sigma, at most env_latency_max (0: 10x
    # the median), drawn per episode and call (a rerun waits as long). 0: none.
    env_latency_median: float = field(0.0, ge=0)
    env_latency_sigma: float = field(1.0, ge=0)
    env_latency_max: float = field(0.0, ge=0)
    # How the python tool's sandbox isolates model code (envs/sandbox.py):
    # "namespaces" (user, pid, mount, network namespaces on a minimal root, seccomp
    # allow-list) or "filters" (seccomp and Landlock only, for hosts without user
    # namespaces; no writable scratch). A host lacking a required layer stops the
    # run before any compute.
    env_isolation: str = field("namespaces", choices=("namespaces", "filters"))

    @property
    def env_latency_most(self) -> float:
        return self.env_latency_max or 10 * self.env_latency_median

    @property
    def reward_name(self) -> str:
        return TASKS[self.source].auto_reward if self.reward == "auto" else self.reward

    def __post_init__(self):
        super().__post_init__()
        if self.source not in TASKS:
            fail(self._f("source"), f"must be one of {tuple(TASKS)}, got {self.source!r} "
                 "(a task registered in dora_jax/tasks)")
        name = TASKS[self.source].needs
        # "env" is checked both ways below.
        if name and self.source != "env" and not getattr(self, name):
            fail(self._f(name), f"data.source={self.source!r} needs data.{name}")
        if self.source == "reasoning_gym":
            reason = refusal(self.task)
            if reason:
                fail(self._f("task"), reason)
        if (self.source == "env") != bool(self.env):
            fail(self._f("env"), "data.source='env' and data.env (an environment's name) "
                 "go together" if self.env else "data.source='env' needs data.env, an "
                 "environment's name (dora_jax/envs: calculator, python, guess)")
        if self.env_latency_median and self.env_latency_most >= self.env_timeout:
            fail(self._f("env_latency_max"), f"calls may be delayed {self.env_latency_most} s, "
                 f"not less than data.env_timeout {self.env_timeout} s: they would time out")
        if (self.reward_name == "env") != (self.source == "env"):
            fail(self._f("reward"), "reward 'env' (the environment's) is the reward of "
                 "data.source='env', and only of it")
        if TASKS[self.source].text and not self.tokenizer:
            fail(self._f("tokenizer"), f"data.source={self.source!r} builds prompts with a "
                  "tokenizer: set data.tokenizer or model.checkpoint (a directory with "
                  "tokenizer.json)")
        if self.reward_name in TEXT_REWARDS and not self.tokenizer:
            fail(self._f("tokenizer"), f"reward {self.reward_name!r} reads decoded text: set "
                  "data.tokenizer or model.checkpoint")
