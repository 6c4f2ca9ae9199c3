"""`jsonl`: prompts from a JSONL file (data/prompts.read_jsonl): token ids, or text
encoded by the run's tokenizer when it names one; scored by `exact_match` unless
`data.reward` names another."""

from __future__ import annotations

from dora_jax.data import prompts
from dora_jax.tasks.base import Task, register, tokenizer_for


@register
class Jsonl(Task):
    name = "jsonl"
    reward = "exact_match"
    needs = "path"

    def records(self, cfg, tokenizer=None) -> list[dict]:
        tokenizer = tokenizer or tokenizer_for(cfg)
        return prompts.read_jsonl(cfg.data.path,
                                  None if tokenizer is None else tokenizer.encode,
                                  vocab_size=cfg.model.vocab_size)
