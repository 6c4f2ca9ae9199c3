"""Token-level tasks with verifiable rewards: their prompts and correct responses (their
rewards are rewards/tokens.py's; the reward pool that scores them in worker processes
is rewards/pool.py).

Token ids 0, 1, 2 are PAD, EOS and BOS in every built-in task; symbols start at 3.

`residue`: a synthetic task a randomly initialised tiny model can improve on within
a short CPU run. The prompt is BOS, a cue symbol (one of `modulus` consecutive ids),
then random symbols; the reward is the fraction of response tokens (EOS excluded)
whose id is congruent to the cue modulo `modulus`. A uniform random policy scores
about 1/modulus; the optimum is 1. The target depends on the prompt, so the policy
must read the cue.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

PAD, EOS, BOS = 0, 1, 2
FIRST_SYMBOL = 3

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


def countdown_prompts(num_prompts: int, vocab_size: int, *, median: float = 12.0,
                      sigma: float = 1.1, max_count: int = 255, seed: int = 0) -> list[dict]:
    """`countdown`: a long-tailed task whose lengths the policy itself produces.

    The prompt [BOS, n(L)] asks for the countdown n(L-1), n(L-2), ..., n(0), EOS, where
    number k is token FIRST_SYMBOL + k: a correct response is L + 1 tokens long, its
    length set by the prompt alone, never by the engine's limit (L <= max_count, and a
    config keeps max_count + 1 <= max_decode_len). L is lognormal (log median, sigma)
    rounded and clipped to [1, max_count]: with the defaults, 512 prompts give a
    response max/mean of 11-13 and p90/p50 of about 3-4 (seeds 0-7), the shape of the
    DORA paper's workload (max/mean about 12). Ids are stable: `countdown-<i>`."""
    if FIRST_SYMBOL + max_count > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} too small for counts up to {max_count} "
                         f"(needs {FIRST_SYMBOL + max_count})")
    rng = np.random.default_rng(seed)
    counts = np.clip(np.rint(median * np.exp(sigma * rng.standard_normal(num_prompts))),
                     1, max_count).astype(int)
    return [{"prompt_id": f"countdown-{i}", "tokens": [BOS, FIRST_SYMBOL + int(n)],
             "count": int(n)} for i, n in enumerate(counts)]


def countdown_target(record: dict) -> list[int]:
    """The correct response (EOS included) of a countdown record."""
    return [FIRST_SYMBOL + k for k in range(record["count"] - 1, -1, -1)] + [EOS]


# The correct response of a record, by task (reward name): what a supervised warm
# start imitates.
DEMONSTRATIONS: dict[str, Callable[[dict], list]] = {"countdown": countdown_target}


def demonstration_fn(name: str) -> Callable[[dict], list]:
    """The correct response of a record of task `name`, for a supervised warm start."""
    if name not in DEMONSTRATIONS:
        raise ValueError(f"task {name!r} has no demonstrations to imitate; tasks with "
                         f"them: {sorted(DEMONSTRATIONS)}")
    return DEMONSTRATIONS[name]
