"""`residue`: a synthetic token task a randomly initialised tiny model can improve on
within a short CPU run.

The prompt is BOS, a cue symbol (one of `modulus` consecutive ids), then random
symbols; the reward (rewards/tokens.residue_reward) is the fraction of response
tokens (EOS excluded) whose id is congruent to the cue modulo `modulus`. A uniform
random policy scores about 1/modulus; the optimum is 1. The target depends on the
prompt, so the policy must read the cue.
"""

from __future__ import annotations

import numpy as np

from dora_jax.data import prompts
from dora_jax.rewards.tokens import BOS, FIRST_SYMBOL
from dora_jax.tasks.base import Task, register


def residue_prompts(num_prompts: int, vocab_size: int, *, prompt_len: int = 6,
                    modulus: int = 4, seed: int = 0) -> list[dict]:
    """`num_prompts` residue-task records with stable ids `residue-<i>`."""
    if vocab_size - FIRST_SYMBOL < modulus:
        raise ValueError(f"vocab_size {vocab_size} too small for modulus {modulus}")
    rng = np.random.default_rng(seed)
    records = []
    for i in range(num_prompts):
        cue = FIRST_SYMBOL + int(rng.integers(modulus))
        filler = rng.integers(FIRST_SYMBOL, vocab_size, size=prompt_len - 2)
        records.append({"prompt_id": f"residue-{i}", "tokens": [BOS, cue, *map(int, filler)],
                        "target": cue % modulus, "modulus": modulus})
    return records


@register
class Residue(Task):
    name = "residue"
    reward = "residue"

    def records(self, cfg, tokenizer=None) -> list[dict]:
        d, vocab = cfg.data, cfg.model.vocab_size
        return prompts.in_memory(residue_prompts(
            d.num_prompts, vocab, prompt_len=d.prompt_len, modulus=d.modulus, seed=cfg.seed),
            vocab)
