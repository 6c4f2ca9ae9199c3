"""Answer extraction and the text verifiers: hand-written answers, hostile inputs,
and the reward pool's worker threads."""

import threading
from fractions import Fraction

import pytest
from _char_tokenizer import END_TURN, EOS, CharTokenizer

from dora_jax.rewards import verifiers as v

# ------------------------------------------------------------------ extraction

@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"\boxed{1} then \boxed{2} and finally \boxed{x^{2}+1}", "x^{2}+1"),
    (r"\fbox{7}", "7"),
    (r"\boxed{3} and \fbox{\sqrt{\frac{a}{b}}}", r"\sqrt{\frac{a}{b}}"),
    (r"\boxed {42}", "42"),
    (r"\boxed{2} but then \boxed{\frac{1}{2}", None),  # the last box never closes
    ("the answer is 5", None),
])
def test_extract_boxed(text, expected):
    assert v.extract_boxed(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("step one\n#### 1,234", "1234"),
    ("#### $18", "18"),
    ("#### 5 first\nthen #### -3.5 dollars", "-3.5"),
    ("#### 12.\n", "12"),
    ("no marker, just 42", None),
    ("#### none here\n7", None),  # the number must follow the marker on its line
])
def test_extract_gsm8k_answer(text, expected):
    assert v.extract_gsm8k_answer(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("It is 12.", "12"),
    ("first -3.5, then 1,000,000 apples", "1000000"),
    ("lists stay apart: 1, 2, 3", "3"),
    ("costs $4.50", "4.50"),
    ("nothing numeric", None),
])
def test_last_number(text, expected):
    assert v.last_number(text) == expected


def test_extract_answer_tag_takes_the_last():
    assert v.extract_answer_tag("<answer>1</answer> no, <answer>\n 2 \n</answer>") == "2"
    assert v.extract_answer_tag("<answer>unclosed") is None


# ------------------------------------------------------------------ math

@pytest.mark.parametrize("gold, response", [
    (r"\frac{3}{4}", r"So the probability is \boxed{0.75}."),
    ("0.75", r"\boxed{\frac{3}{4}}"),
    ("3/4", r"\boxed{3/4}"),
    ("12", r"\boxed{12}"),
    ("12", "The answer is 12."),
    (r"\sqrt{2}/2", r"we get $\boxed{\frac{\sqrt2}{2}}$"),
    ("x^2+1", r"\boxed{1 + x^2}"),
])
def test_math_reward_accepts_equivalent_forms(gold, response):
    assert v.math_reward({"answer": gold}, response) == 1.0


@pytest.mark.parametrize("gold, response", [
    ("12", r"\boxed{13}"),
    (r"\frac{3}{4}", r"\boxed{\frac{4}{3}}"),
    ("12", "I could not solve it."),
    ("12", ""),
    ("x^2+1", r"\boxed{x^2-1}"),
])
def test_math_reward_rejects_wrong_answers(gold, response):
    assert v.math_reward({"answer": gold}, response) == 0.0


def test_math_reward_gold_that_does_not_parse_raises():
    with pytest.raises(ValueError, match="does not parse"):
        v.math_reward({"answer": "", "prompt_id": "p"}, r"\boxed{1}")


def test_math_reward_works_off_the_main_thread():
    results, errors = [], []

    def run():
        try:
            results.append(v.math_reward({"answer": r"\frac{3}{4}"}, r"\boxed{0.75}"))
            results.append(v.math_reward({"answer": "5"}, r"\boxed{6}"))
        except Exception as e:  # noqa: BLE001 — reported by the assertion below
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert not errors and results == [1.0, 0.0]


def test_math_reward_through_the_reward_pool():
    tok = CharTokenizer()
    from dora_jax.rewards.pool import RewardPool

    pool = RewardPool(v.token_reward(v.math_reward, tok), num_workers=1, timeout=60)
    try:
        good = pool.submit({"answer": "7"}, tok.encode(r"thus \boxed{7}") + [EOS])
        bad = pool.submit({"answer": "7"}, tok.encode(r"thus \boxed{8}") + [EOS])
        assert good.result(60) == (1.0, None)
        assert bad.result(60) == (0.0, None)
    finally:
        pool.close()


# ------------------------------------------------------------------ gsm8k

@pytest.mark.parametrize("gold, response, expected", [
    ("72", "She sold 48 + 24 = 72 clips.\n#### 72", 1.0),
    ("72", "#### 71", 0.0),
    ("1234", "#### 1,234", 1.0),
    ("18", "#### $18", 1.0),
    ("72", r"so \boxed{72}", 1.0),
    ("72", "so she has 72 clips.", 1.0),
    ("72", "so she has 72 clips, not 70.", 0.0),
    ("7", "\\boxed{5} ... on reflection\n#### 7", 1.0),  # '####' wins over a box
    ("1000000", "#### 1000001", 0.0),  # integers are exact, not within 1e-6
    ("0.5", "#### 0.5000001", 1.0),  # decimals: within 1e-6 relative
    ("0.5", "#### 0.51", 0.0),
    ("12", "#### 12.0", 1.0),
    ("-3", "the change is -3", 1.0),
    ("5", "no idea", 0.0),
])
def test_gsm8k_reward(gold, response, expected):
    assert v.gsm8k_reward({"answer": gold}, response) == expected


def test_gsm8k_reward_bad_gold_raises():
    with pytest.raises(ValueError, match="not a number"):
        v.gsm8k_reward({"answer": "seven"}, "#### 7")


# ------------------------------------------------------------------ countdown

COUNTDOWN = {"numbers": [1, 2, 3, 4], "target": 10}


@pytest.mark.parametrize("response, expected", [
    ("1 + 2 + 3 + 4", 1.0),
    ("4 * (3 - 1) + 2", 1.0),
    ("-(-1 - 2 - 3 - 4)", 1.0),
    ("Let me think.\n4 * 3 - 2\n<answer>(4 - 2) * (3 + 1 + 1)</answer>", 0.0),  # 1 twice
    ("First try 1+2.\nThen:\n\n4 * 2 + 3 - 1\n", 1.0),  # the last line
    ("<answer> 2 * (4 + 1) </answer>\nso 10", 1.0),  # the tag, not the last line
    ("1 + 2 + 3", 0.0),  # 6, not 10
    ("10", 0.0),  # 10 is not a given number
    ("1 + 2 + 3 + 4 + 0", 0.0),
    ("1 + 2 + 3 + 4.0", 0.0),  # floats are not the given numbers
    ("1 + 2 + 3 + 4 = 10", 0.0),
    ("", 0.0),
])
def test_countdown_reward(response, expected):
    assert v.countdown_reward(COUNTDOWN, response) == expected


def test_countdown_counts_repeated_numbers():
    assert v.countdown_reward({"numbers": [5, 2], "target": 10}, "5 + 5") == 0.0
    assert v.countdown_reward({"numbers": [5, 5, 2], "target": 10}, "5 + 5") == 1.0
    assert v.countdown_reward({"numbers": [5, 5, 2], "target": 10}, "5 * 2") == 1.0


def test_countdown_is_exact_with_fractions():
    # In floats 8 / (3 - 8 / 3) is 23.999999999999996, not 24.
    assert 8 / (3 - 8 / 3) != 24
    assert v.countdown_reward({"numbers": [3, 3, 8, 8], "target": 24}, "8 / (3 - 8 / 3)") == 1.0
    assert v.safe_arithmetic("1 / 3 + 1 / 3", [1, 1, 3, 3]) == Fraction(2, 3)


HIT = []


@pytest.mark.parametrize("response", [
    "__import__('os')",
    "__import__('os').system('true')",
    "2**99999999",
    "2 ** 3",
    "(lambda: HIT.append(1))()",
    "HIT.append(1) or 10",
    "[HIT.append(1)]",
    "().__class__",
    "x + 10",
    "abs(-10)",
    "1 + 2 + 3 + 4; HIT.append(1)",
    "9" * 5000,  # beyond Python's integer-literal limit
    "(" * 500 + "10" + ")" * 500,
    "1 // 1 + 9",
    "10 % 11",
    "1 / (2 - 2)",
])
def test_countdown_never_executes_and_scores_zero(response):
    record = {"numbers": [1, 2, 3, 4, 9, 10, 11], "target": 10}
    assert v.countdown_reward(record, response) == 0.0
    assert HIT == []


def test_safe_arithmetic_guards_giant_intermediates():
    big = 10**60
    assert v.safe_arithmetic(f"{big} + {big}", [big, big]) == 2 * big
    assert v.safe_arithmetic(f"{big} * {big}", [big, big]) is None


def test_countdown_malformed_record_raises():
    with pytest.raises(KeyError):
        v.countdown_reward({"target": 3}, "1 + 2")


# ------------------------------------------------------------------ adapters

def test_token_reward_stops_at_the_first_stop_id():
    tok = CharTokenizer()
    reward = v.token_reward(v.gsm8k_reward, tok)
    record = {"answer": "42"}
    # Decoded whole, the tail would join the answer: "#### 4299".
    assert reward(record, tok.encode("#### 42") + [END_TURN] + tok.encode("99")) == 1.0
    assert reward(record, tok.encode("#### 42") + [EOS] + tok.encode("99")) == 1.0
    assert reward(record, tok.encode("#### 42") + tok.encode("99")) == 0.0
    assert reward(record, []) == 0.0


def test_token_reward_falls_back_to_eos_without_stop_ids():
    class NoStops(CharTokenizer):
        stop_ids = None

    reward = v.token_reward(v.gsm8k_reward, NoStops())
    tok = CharTokenizer()
    assert reward({"answer": "42"}, tok.encode("#### 42") + [EOS] + tok.encode("7")) == 1.0


def test_text_reward_by_name_and_by_record():
    assert set(v.VERIFIERS) == {"gsm8k", "math", "countdown_expr", "reasoning_gym"}
    assert v.text_reward("gsm8k") is v.gsm8k_reward
    by_record = v.text_reward("by_record")
    assert by_record({"verifier": "gsm8k", "answer": "3"}, "#### 3") == 1.0
    assert by_record({"verifier": "countdown_expr", **COUNTDOWN}, "1+2+3+4") == 1.0
    with pytest.raises(ValueError, match="unknown text reward"):
        v.text_reward("nope")


def test_the_config_names_the_rewards_that_exist():
    """config sits below rewards and cannot import them: its lists of reward names must
    be the registries' keys, each name once."""
    from dora_jax import config
    from dora_jax.rewards import tokens

    assert config.TEXT_REWARDS == (*v.VERIFIERS, "by_record")
    assert config.TOKEN_REWARDS == tuple(tokens.REWARDS)
    assert not set(config.TEXT_REWARDS) & set(config.TOKEN_REWARDS)
