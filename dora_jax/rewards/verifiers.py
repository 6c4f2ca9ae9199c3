"""Answer extraction and verifiers for text tasks with checkable answers.

A text reward is `(record, response_text) -> float`; `TokenReward` adapts one to the
token-level `rewards.tokens.RewardFn` the reward pool calls. The response is untrusted: a
verifier never executes it (no eval, exec or sympy string parsing of it; arithmetic
goes through our own `ast`-checked parser), reads it in linear time, and returns a
score on any text, never an exception. A malformed record (a gold answer that cannot
be read, a missing key, a refused reasoning_gym task) raises, so the reward pool
reports it as a failure with its reason instead of a silent zero.

Wall-clock and memory limits are not this module's: a run scores in worker processes
(rewards/pool.py) that are killed past `coordinator.reward_timeout`, so
math-verify is called with its own signal-based timeouts off.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from fractions import Fraction

from dora_jax.rewards import reasoning_gym_scores
from dora_jax.rewards.expressions import literals_used, safe_arithmetic  # noqa: F401 - literals_used re-exported

TextReward = Callable[[dict, str], float]

# A number as written in prose: optional sign, thousands groups or plain digits, and
# an optional decimal part ("1,234.5", "-12", ".5"). Lists like "1, 2" stay apart
# because a group after a comma must have exactly three digits. ASCII digits only:
# `\d` would also take other scripts' digits, which the answer formats do not ask for.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\d)|-?\.\d+", re.ASCII)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# Python refuses to read longer integers (sys.get_int_max_str_digits); no answer of
# ours comes near it, so a longer number is simply not an answer.
_MAX_DIGITS = 4000


def last_number(text: str) -> str | None:
    """The last number in `text` (commas removed), or None."""
    found = None
    for found in _NUMBER.finditer(text.replace("$", "")):
        pass
    return found.group().replace(",", "") if found else None


def _first_number(text: str) -> str | None:
    found = _NUMBER.search(text.replace("$", ""))
    return found.group().replace(",", "") if found else None


def extract_gsm8k_answer(text: str) -> str | None:
    """The number after the last `####` (commas and `$` removed), or None."""
    at = text.rfind("####")
    if at < 0:
        return None
    # Only the first line after the marker: a number further down is not the answer.
    tail = text[at + 4:].lstrip().split("\n", 1)[0]
    return _first_number(tail)


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` or `\\fbox{...}`, or None.

    Braces are counted, so `\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`; an unclosed
    box gives None. One pass to find the last box, one over its content.
    """
    start = None
    for m in _BOXED.finditer(text):
        start = m.end()
    if start is None:
        return None
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip()
    # An unclosed last box: an earlier, complete one is not the final answer either.
    return None


def extract_answer_tag(text: str) -> str | None:
    """The content of the last `<answer>...</answer>`: from the last closing tag back
    to the nearest opening tag before it, stripped; or None. Two reverse searches,
    so a response of nothing but opening tags costs linear time, not quadratic."""
    close = text.rfind("</answer>")
    if close < 0:
        return None
    open_ = text.rfind("<answer>", 0, close)
    if open_ < 0:
        return None
    return text[open_ + len("<answer>"):close].strip()


def _last_line(text: str) -> str:
    for line in reversed(text.splitlines()):
        if line.strip():
            return line.strip()
    return ""


# ------------------------------------------------------------------ math (math-verify)

def _math_verify():
    # Imported on first use: it pulls in sympy and the LaTeX grammar. Its plain-
    # expression extraction hands sympy's parse_expr only digits, operators and
    # brackets (its regex admits no names), so no response text can call anything.
    import math_verify

    return math_verify


def math_reward(record: dict, text: str) -> float:
    """1.0 iff the response's final answer equals `record["answer"]` mathematically.

    The response is read for a `\\boxed{}` answer first, then LaTeX or a plain
    expression (so `\\boxed{3/4}`, `0.75` and `The answer is 12.` all work); equality
    is math-verify's (`\\frac{3}{4}` == `0.75`). A gold answer that does not parse
    raises ValueError; a response math-verify cannot read scores 0.
    """
    mv = _math_verify()
    answer = str(record["answer"])
    gold = mv.parse("\\boxed{" + answer + "}",
                    extraction_config=[mv.LatexExtractionConfig()], parsing_timeout=None)
    if not gold:
        gold = mv.parse(answer, parsing_timeout=None)
    if not gold:
        raise ValueError(f"gold answer {answer!r} of {record.get('prompt_id')!r} does not parse")
    try:
        pred = mv.parse(text, extraction_config=[mv.LatexExtractionConfig(),
                                                 mv.ExprExtractionConfig()],
                        parsing_timeout=None)
        return float(bool(pred) and mv.verify(gold, pred, timeout_seconds=None))
    except Exception:  # noqa: BLE001 — whatever the text makes math-verify do, it scores 0
        return 0.0


# ------------------------------------------------------------------ gsm8k (numeric)

def _fraction(s: str) -> Fraction:
    s = s.replace(",", "").replace("$", "").strip()
    if len(s) > _MAX_DIGITS:
        raise ValueError(f"a number of {len(s)} characters")
    return Fraction(s)


def gsm8k_reward(record: dict, text: str) -> float:
    """1.0 iff the response's number equals `record["answer"]`.

    The response's answer is the number after `####` if there is one, else in the
    last `\\boxed{}`, else the last number. Integers must match exactly; otherwise
    a relative difference up to 1e-6 is accepted.
    """
    gold_text = str(record["answer"])
    try:
        gold = _fraction(gold_text)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"gold answer {gold_text!r} of {record.get('prompt_id')!r} "
                         "is not a number") from None
    if "####" in text:
        pred_text = extract_gsm8k_answer(text)
    else:
        boxed = extract_boxed(text)
        pred_text = _first_number(boxed) if boxed is not None else last_number(text)
    if pred_text is None:
        return 0.0
    try:
        pred = _fraction(pred_text)
    except (ValueError, ZeroDivisionError):
        return 0.0
    if gold.denominator == 1 and pred.denominator == 1 and "." not in gold_text + pred_text:
        return float(pred == gold)
    return float(abs(pred - gold) <= abs(gold) * Fraction(1, 10**6))


# ------------------------------------------------------------------ countdown (expressions.py)

def countdown_expression(text: str) -> str:
    """The response's final expression: the last `<answer>` content, else the last
    non-empty line."""
    tagged = extract_answer_tag(text)
    return tagged if tagged is not None else _last_line(text)


def countdown_reward(record: dict, text: str) -> float:
    """1.0 iff the response's expression reaches `record["target"]` exactly, using
    only `record["numbers"]` (each at most as often as given) and + - * /."""
    value = safe_arithmetic(countdown_expression(text), record["numbers"])
    return float(value is not None and value == Fraction(record["target"]))


# ------------------------------------------------------------------ reasoning_gym

def reasoning_gym_reward(record: dict, text: str) -> float:
    """The record's reasoning_gym score of the response's answer (the last `<answer>`
    content, else the last non-empty line): the dataset's own `score_answer` for the
    tasks vetted in reasoning_gym_scores.py, our arithmetic parser for countdown and
    puzzle24. A refused task raises ValueError: it never sees the text."""
    reasoning_gym_scores.entry(record)  # a bad record raises here, before the text
    answer = extract_answer_tag(text)
    if answer is None:
        answer = _last_line(text)
    try:
        return reasoning_gym_scores.score(record, answer)
    except Exception:  # noqa: BLE001 — a task's scorer that chokes on the text scores 0
        return 0.0


# The text verifiers by name; config.TEXT_REWARDS lists these names and "by_record".
VERIFIERS: dict[str, TextReward] = {
    "gsm8k": gsm8k_reward,
    "math": math_reward,
    "countdown_expr": countdown_reward,
    "reasoning_gym": reasoning_gym_reward,
}


def record_reward(record: dict, text: str) -> float:
    """The verifier the record names in its `verifier` key (records of mixed tasks).
    Scores one response in the calling process: it never executes the text, but
    time and memory limits are the reward pool's."""
    return text_reward(record["verifier"])(record, text)


def text_reward(name: str) -> TextReward:
    """A text reward by name: one of VERIFIERS, or "by_record" for `record_reward`."""
    if name == "by_record":
        return record_reward
    if name not in VERIFIERS:
        raise ValueError(f"unknown text reward {name!r}; known: {sorted(VERIFIERS)} "
                         "and 'by_record'")
    return VERIFIERS[name]


class TokenReward:
    """A text reward on token ids: `(record, response_ids) -> float`.

    The response is cut at its first stop id (`tokenizer.stop_ids`, else `eos_id`)
    and decoded without special tokens. Picklable (the reward pool sends it to its
    worker processes): it keeps the text reward by reference and the tokenizer.
    """

    def __init__(self, reward: TextReward, tokenizer):
        self.reward, self.tokenizer = reward, tokenizer
        self.stops = frozenset(getattr(tokenizer, "stop_ids", None) or (tokenizer.eos_id,))
        self.__name__ = f"token_{getattr(reward, '__name__', 'reward')}"
        self.__doc__ = reward.__doc__

    def text(self, response: Sequence[int]) -> str:
        """The response's text up to its first stop id."""
        ids = []
        for t in response:
            if int(t) in self.stops:
                break
            ids.append(int(t))
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def __call__(self, record: dict, response: Sequence[int]) -> float:
        return self.reward(record, self.text(response))


def token_reward(reward: TextReward, tokenizer) -> TokenReward:
    """Adapts a text reward to the token signature `(record, response_ids) -> float`."""
    return TokenReward(reward, tokenizer)
