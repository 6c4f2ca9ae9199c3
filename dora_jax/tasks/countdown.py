"""`countdown`: a long-tailed token task whose lengths the policy itself produces.

The prompt [BOS, n(L)] asks for the countdown n(L-1), n(L-2), ..., n(0), EOS, where
number k is token FIRST_SYMBOL + k (rewards/tokens.countdown_target): a correct
response is L + 1 tokens long, its length set by the prompt alone, never by the
engine's limit (L <= max_count, and a config keeps max_count + 1 <= max_decode_len).
"""

from __future__ import annotations

import numpy as np

from dora_jax.data import prompts
from dora_jax.rewards.tokens import BOS, FIRST_SYMBOL
from dora_jax.tasks.base import Task, register


def countdown_prompts(num_prompts: int, vocab_size: int, *, median: float = 12.0,
                      sigma: float = 1.1, max_count: int = 255, seed: int = 0) -> list[dict]:
    """`num_prompts` countdown records with stable ids `countdown-<i>`.

    L is lognormal (log median, sigma) rounded and clipped to [1, max_count]: with the
    defaults, 512 prompts give a response max/mean of 11-13 and p90/p50 of about 3-4
    (seeds 0-7), the shape of the DORA paper's workload (max/mean about 12)."""
    if FIRST_SYMBOL + max_count > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} too small for counts up to {max_count} "
                         f"(needs {FIRST_SYMBOL + max_count})")
    rng = np.random.default_rng(seed)
    counts = np.clip(np.rint(median * np.exp(sigma * rng.standard_normal(num_prompts))),
                     1, max_count).astype(int)
    return [{"prompt_id": f"countdown-{i}", "tokens": [BOS, FIRST_SYMBOL + int(n)],
             "count": int(n)} for i, n in enumerate(counts)]


@register
class Countdown(Task):
    name = "countdown"
    reward = "countdown"

    def records(self, cfg, tokenizer=None) -> list[dict]:
        d, vocab = cfg.data, cfg.model.vocab_size
        return prompts.in_memory(countdown_prompts(
            d.num_prompts, vocab, median=d.count_median, sigma=d.count_sigma,
            max_count=d.max_count, seed=cfg.seed), vocab)
