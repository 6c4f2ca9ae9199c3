"""Answer extraction and verifiers for text tasks with checkable answers.

A text reward is `(record, response_text) -> float`; `token_reward` adapts one to the
token-level `tasks.RewardFn` the reward pool calls. A malformed response scores 0.0;
a malformed record (a gold answer that cannot be read, a missing key) raises, so the
reward pool reports it as a failure with its reason instead of a silent zero.

Rewards run on the pool's worker threads, so nothing here may use `signal`: math-verify
is called with its own (signal-based) timeouts off, and the pool's timeout applies.
"""

from __future__ import annotations

import ast
import json
import re
import threading
from collections import Counter
from fractions import Fraction
from typing import Any, Callable, Sequence

TextReward = Callable[[dict, str], float]

# A number as written in prose: optional sign, thousands groups or plain digits, and
# an optional decimal part ("1,234.5", "-12", ".5"). Lists like "1, 2" stay apart
# because a group after a comma must have exactly three digits.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\d)|-?\.\d+")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def last_number(text: str) -> str | None:
    """The last number in `text` (commas removed), or None."""
    found = _NUMBER.findall(text.replace("$", ""))
    return found[-1].replace(",", "") if found else None


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
    box gives None.
    """
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
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
    return None


def extract_answer_tag(text: str) -> str | None:
    """The content of the last `<answer>...</answer>`, stripped, or None."""
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


# ------------------------------------------------------------------ math (math-verify)

def _math_verify():
    # Imported on first use: it pulls in sympy and the LaTeX grammar.
    import math_verify

    return math_verify


def math_reward(record: dict, text: str) -> float:
    """1.0 iff the response's final answer equals `record["answer"]` mathematically.

    The response is read for a `\\boxed{}` answer first, then LaTeX or a plain
    expression (so `\\boxed{3/4}`, `0.75` and `The answer is 12.` all work); equality
    is math-verify's (`\\frac{3}{4}` == `0.75`). A gold answer that does not parse
    raises ValueError.
    """
    mv = _math_verify()
    answer = str(record["answer"])
    gold = mv.parse("\\boxed{" + answer + "}",
                    extraction_config=[mv.LatexExtractionConfig()], parsing_timeout=None)
    if not gold:
        gold = mv.parse(answer, parsing_timeout=None)
    if not gold:
        raise ValueError(f"gold answer {answer!r} of {record.get('prompt_id')!r} does not parse")
    pred = mv.parse(text, extraction_config=[mv.LatexExtractionConfig(), mv.ExprExtractionConfig()],
                    parsing_timeout=None)
    if not pred:
        return 0.0
    return float(mv.verify(gold, pred, timeout_seconds=None))


# ------------------------------------------------------------------ gsm8k (numeric)

def _fraction(s: str) -> Fraction:
    return Fraction(s.replace(",", "").replace("$", "").strip())


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
    pred = _fraction(pred_text)
    if gold.denominator == 1 and pred.denominator == 1 and "." not in gold_text + pred_text:
        return float(pred == gold)
    return float(abs(pred - gold) <= abs(gold) * Fraction(1, 10**6))


# ------------------------------------------------------------------ countdown (safe eval)

_MAX_EXPR_CHARS = 1000
_MAX_DEPTH = 64
# Far beyond any value reachable from a handful of small numbers; a guard, not a limit
# a correct answer meets.
_MAX_MAGNITUDE = 10**100


class _Rejected(Exception):
    """The expression is not a plain arithmetic expression over the given numbers."""


def _literals(node: ast.AST, depth: int = 0) -> list[int]:
    """The integer literals of an arithmetic-only tree; _Rejected for anything else."""
    if depth > _MAX_DEPTH:
        raise _Rejected("too deeply nested")
    if isinstance(node, ast.Expression):
        return _literals(node.body, depth + 1)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        return _literals(node.left, depth + 1) + _literals(node.right, depth + 1)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _literals(node.operand, depth + 1)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return [node.value]
    raise _Rejected(f"not allowed: {type(node).__name__}")


def _evaluate(node: ast.AST) -> Fraction:
    """Exact value of a tree `_literals` accepted."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp):
        return -_evaluate(node.operand)
    left, right = _evaluate(node.left), _evaluate(node.right)
    if isinstance(node.op, ast.Add):
        value = left + right
    elif isinstance(node.op, ast.Sub):
        value = left - right
    elif isinstance(node.op, ast.Mult):
        value = left * right
    else:
        if right == 0:
            raise _Rejected("division by zero")
        value = left / right
    if abs(value.numerator) > _MAX_MAGNITUDE or value.denominator > _MAX_MAGNITUDE:
        raise _Rejected("intermediate value too large")
    return value


def safe_arithmetic(expression: str, numbers: Sequence[int]) -> Fraction | None:
    """The exact value of `expression` if it is built only from integer literals,
    + - * /, unary minus and parentheses, uses each literal at most as often as it
    appears in `numbers`, and divides by no zero; else None. Never executes code."""
    expression = expression.strip()
    if not expression or len(expression) > _MAX_EXPR_CHARS:
        return None
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    try:
        used = Counter(_literals(tree))
        if used - Counter(int(n) for n in numbers):
            return None
        return _evaluate(tree)
    except _Rejected:
        return None


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

_rg_lock = threading.Lock()
_rg_datasets: dict[tuple, Any] = {}


def _rg_dataset(record: dict):
    task, seed, size = record["rg_task"], record["rg_seed"], record["rg_size"]
    config = record.get("rg_config") or {}
    key = (task, seed, size, json.dumps(config, sort_keys=True))
    with _rg_lock:
        if key not in _rg_datasets:
            import reasoning_gym

            _rg_datasets[key] = reasoning_gym.create_dataset(task, size=size, seed=seed, **config)
        return _rg_datasets[key]


def reasoning_gym_entry(record: dict) -> dict:
    """The reasoning_gym entry a record was made from, re-created from its
    `rg_task`, `rg_seed`, `rg_size`, `rg_config` and `rg_index` (datasets cached)."""
    ds = _rg_dataset(record)
    with _rg_lock:  # generators are not known to be thread-safe
        entry = ds[record["rg_index"]]
    if entry["question"] != record["question"]:
        raise ValueError(f"{record.get('prompt_id')!r}: the installed reasoning_gym makes a "
                         "different question for this seed and index than the record holds")
    return entry


def reasoning_gym_reward(record: dict, text: str) -> float:
    """The record's reasoning_gym dataset's own `score_answer` of the response's
    answer: the last `<answer>` content, else the last non-empty line."""
    entry = reasoning_gym_entry(record)
    answer = extract_answer_tag(text)
    if answer is None:
        answer = _last_line(text)
    return float(_rg_dataset(record).score_answer(answer=answer, entry=entry))


TEXT_REWARDS: dict[str, TextReward] = {
    "gsm8k": gsm8k_reward,
    "math": math_reward,
    "countdown_expr": countdown_reward,
    "reasoning_gym": reasoning_gym_reward,
}


def record_reward(record: dict, text: str) -> float:
    """The verifier the record names in its `verifier` key (records of mixed tasks)."""
    return text_reward(record["verifier"])(record, text)


def text_reward(name: str) -> TextReward:
    """A text reward by name: one of TEXT_REWARDS, or "by_record" for `record_reward`."""
    if name == "by_record":
        return record_reward
    if name not in TEXT_REWARDS:
        raise ValueError(f"unknown text reward {name!r}; known: {sorted(TEXT_REWARDS)} "
                         "and 'by_record'")
    return TEXT_REWARDS[name]


def token_reward(reward: TextReward, tokenizer) -> Callable[[dict, Sequence[int]], float]:
    """Adapts a text reward to the token signature `(record, response_ids) -> float`.

    The response is cut at its first stop id (`tokenizer.stop_ids`, else `eos_id`)
    and decoded without special tokens.
    """
    stops = frozenset(getattr(tokenizer, "stop_ids", None) or (tokenizer.eos_id,))

    def score(record: dict, response: Sequence[int]) -> float:
        ids = []
        for t in response:
            if int(t) in stops:
                break
            ids.append(int(t))
        return reward(record, tokenizer.decode(ids, skip_special_tokens=True))

    score.__name__ = f"token_{getattr(reward, '__name__', 'reward')}"
    score.__doc__ = reward.__doc__
    return score
