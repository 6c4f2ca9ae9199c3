"""The token tasks: residue and countdown prompts, and their rewards by hand."""

import numpy as np
import pytest

from dora_jax.data import prompts
from dora_jax.rewards import tokens
from dora_jax.tasks.countdown import countdown_prompts
from dora_jax.tasks.residue import residue_prompts


def test_residue_reward_by_hand():
    record = {"target": 1, "modulus": 4}
    # 5 % 4 = 1 (hit), 6 % 4 = 2, 9 % 4 = 1 (hit); EOS (1) is not a response token.
    assert tokens.residue_reward(record, [5, 6, 9, tokens.EOS]) == pytest.approx(2 / 3)
    assert tokens.residue_reward(record, [tokens.EOS]) == 0.0
    assert tokens.residue_reward(record, [13, 17]) == 1.0


def test_residue_prompts_are_stable_and_valid():
    a = residue_prompts(10, 128, seed=3)
    b = residue_prompts(10, 128, seed=3)
    assert a == b
    assert [r["prompt_id"] for r in a] == [f"residue-{i}" for i in range(10)]
    for r in a:
        assert r["tokens"][0] == tokens.BOS
        assert all(tokens.FIRST_SYMBOL <= t < 128 for t in r["tokens"][1:])
        assert r["target"] == r["tokens"][1] % 4
    prompts.in_memory(a, vocab_size=128)


def test_unknown_reward_name():
    with pytest.raises(ValueError, match="unknown reward"):
        tokens.reward_fn("nope")


def test_countdown_reward_by_hand():
    record = {"count": 3}  # the countdown 2, 1, 0 then EOS: tokens 5, 4, 3, 1
    assert tokens.countdown_target(record) == [5, 4, 3, tokens.EOS]
    assert tokens.countdown_reward(record, [5, 4, 3, tokens.EOS]) == 1.0
    assert tokens.countdown_reward(record, [5, 4, tokens.EOS]) == pytest.approx(2 / 4)  # early
    assert tokens.countdown_reward(record, [5, 4, 3, 9, 9, tokens.EOS]) == pytest.approx(3 / 6)
    assert tokens.countdown_reward(record, [9, 4, 3, tokens.EOS]) == pytest.approx(3 / 4)
    assert tokens.countdown_reward(record, []) == 0.0


def test_countdown_lengths_are_long_tailed_and_fit_the_decode_limit():
    """The config's workload shape (seed 0, 512 prompts, max_count 255 for a
    256-token decode limit): correct responses have max/mean >= 8 and p90/p50 >= 3,
    and none is longer than the limit."""
    records = countdown_prompts(512, 260, seed=0)
    assert records == countdown_prompts(512, 260, seed=0)
    lengths = np.array([len(tokens.countdown_target(r)) for r in records])
    assert lengths.max() / lengths.mean() >= 8
    assert np.percentile(lengths, 90) / np.percentile(lengths, 50) >= 3
    assert lengths.max() <= 256 and lengths.min() >= 2
    for r in records:
        assert r["tokens"] == [tokens.BOS, tokens.FIRST_SYMBOL + r["count"]]
    prompts.in_memory(records, vocab_size=260)
    with pytest.raises(ValueError, match="vocab_size 200 too small"):
        countdown_prompts(4, 200)
