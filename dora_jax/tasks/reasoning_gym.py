"""`reasoning_gym`: text prompts of a procedural reasoning_gym task (`data.task`,
its dataset's config `data.task_args`), each scored by the verifier its record
names. Which tasks may score model text, and their scoring, are
rewards/reasoning_gym_scores.py's (the table config validates against:
config/vetted_tasks.py)."""

from __future__ import annotations

import json
from typing import Any

from dora_jax.data.prompts import Record
from dora_jax.data.text_records import make_record
from dora_jax.tasks.base import Task, chat_tokenizer, register, text_options


def _json_friendly(value: Any) -> Any:
    # Metadata may hold tuples, sets or objects; only JSON values go in a record.
    return json.loads(json.dumps(value, default=repr))


def reasoning_gym_records(task: str, tokenizer, *, size: int, seed: int,
                          config: dict | None = None, instruction: str | None = None,
                          system_prompt: str | None = None, keep_metadata: bool = False,
                          vocab_size: int | None = None) -> list[Record]:
    """`size` records of a procedural reasoning_gym task (`config` goes to
    `reasoning_gym.create_dataset` as keyword arguments); the same task, size, seed
    and config give the same records.

    Keys: prompt_id (`rg-<task>-<seed>-<i>`), tokens, question, answer (the dataset's
    reference answer), verifier, rg_task, rg_seed, rg_size, rg_index, rg_config (what
    re-creates the entry the dataset's own scoring needs), and with keep_metadata the
    entry's metadata. "countdown" records also hold `numbers` and `target` and use the
    "countdown_expr" verifier; every other task uses "reasoning_gym" (the dataset's
    `score_answer`).
    """
    import reasoning_gym  # type: ignore[import-untyped]

    config = _json_friendly(dict(config or {}))
    dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **config)
    records = []
    for i in range(size):
        entry = dataset[i]
        extra: dict[str, Any] = {"rg_task": task, "rg_seed": seed, "rg_size": size,
                                 "rg_index": i, "rg_config": config}
        verifier = "reasoning_gym"
        if task == "countdown":
            verifier = "countdown_expr"
            extra["numbers"] = [int(n) for n in entry["metadata"]["numbers"]]
            extra["target"] = int(entry["metadata"]["target"])
        if keep_metadata:
            extra["metadata"] = _json_friendly(entry.get("metadata", {}))
        answer = entry.get("answer")
        records.append(make_record(
            tokenizer, f"rg-{task}-{seed}-{i}", entry["question"],
            None if answer is None else str(answer), verifier, instruction=instruction,
            system_prompt=system_prompt, vocab_size=vocab_size, **extra))
    return records


@register
class ReasoningGym(Task):
    name = "reasoning_gym"
    reward = "by_record"
    text = True
    needs = "task"

    def records(self, cfg, tokenizer=None) -> list[dict]:
        d = cfg.data
        return reasoning_gym_records(d.task, chat_tokenizer(cfg, tokenizer),
                                     size=d.num_prompts, seed=cfg.seed,
                                     config=dict(d.task_args), **text_options(cfg))
