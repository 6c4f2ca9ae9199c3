"""Synthetic grade-school word problems in GSM8K's format, and the small tokenizer
the CPU configs use.

GSM8K-format JSONL is one object per line, `question` and `answer`, the answer's
worked solution ending in `#### N`. These problems are generated from templates
(one or two arithmetic steps over small numbers), so the CPU configs and tests have
GSM8K-format data without downloading GSM8K. `python -m dora_jax.data.word_problems`
rewrites the shipped assets (dora_jax/assets/): the problems file and the tokenizer,
a byte-level BPE trained on these problems and on the quickstart's arithmetic task;
both are deterministic, and a test checks the shipped files against a rebuild.
"""

from __future__ import annotations

import json
import os

import numpy as np

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
PROBLEMS_FILE = os.path.join(ASSETS, "word_problems.jsonl")
TOKENIZER_DIR = os.path.join(ASSETS, "tokenizer")
TOKENIZER_VOCAB = 512

_NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jamal"]
_ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "shells", "cookies", "cards"]

# (question template, solution template, answer) over numbers a, b, c.
_TEMPLATES = [
    ("{n} has {a} {i}. {n} gets {b} more {i}. How many {i} does {n} have now?",
     "{n} has {a} + {b} = {r} {i}.", lambda a, b, c: a + b),
    ("{n} had {s} {i} and gave {b} of them away. How many {i} are left?",
     "{n} has {s} - {b} = {r} {i} left.", lambda a, b, c: a),
    ("{n} buys {a} bags with {b} {i} in each bag. How many {i} does {n} buy?",
     "{n} buys {a} * {b} = {r} {i}.", lambda a, b, c: a * b),
    ("{n} has {a} {i}, buys {b} more and then loses {c}. How many {i} does {n} have?",
     "{n} has {a} + {b} = {ab} {i}, then {ab} - {c} = {r}.", lambda a, b, c: a + b - c),
]


def word_problems(num: int, seed: int = 0) -> list[dict]:
    """`num` GSM8K-format problems ({"id", "question", "answer"}); `answer` is a
    worked solution ending in `#### N`."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(num):
        question, solution, result = _TEMPLATES[int(rng.integers(len(_TEMPLATES)))]
        a, b = (int(x) for x in rng.integers(2, 20, size=2))
        c = int(rng.integers(1, a + b))
        values = dict(n=_NAMES[int(rng.integers(len(_NAMES)))],
                      i=_ITEMS[int(rng.integers(len(_ITEMS)))], a=a, b=b, c=c, s=a + b,
                      ab=a + b, r=result(a, b, c))
        out.append({"id": f"word-{seed}-{k}", "question": question.format(**values),
                    "answer": solution.format(**values) + f"\n#### {values['r']}"})
    return out


def tokenizer_corpus() -> list[str]:
    """What the shipped tokenizer is trained on: word problems, the quickstart's
    arithmetic questions with their answers, and the prompt instructions."""
    from dora_jax.data import text_records

    texts = [p["question"] + "\n" + p["answer"] for p in word_problems(2000, seed=1)]
    for a in range(-99, 100):
        texts.append(f"Calculate {a} + {abs(a) % 10}. {a} - {abs(a) % 7} = {a - abs(a) % 7}")
    texts += list(text_records.DEFAULT_INSTRUCTIONS.values()) * 20
    texts += ["<answer>42</answer>", "The answer is 7.", "#### 12", "\\boxed{3}"] * 50
    return texts


def write_assets() -> None:
    """Rewrites dora_jax/assets/: the problems file (200 problems) and the tokenizer."""
    from dora_jax.text.tokenizer import train_tokenizer

    os.makedirs(ASSETS, exist_ok=True)
    with open(PROBLEMS_FILE, "w") as f:
        for p in word_problems(200, seed=0):
            f.write(json.dumps(p) + "\n")
    train_tokenizer(tokenizer_corpus(), TOKENIZER_VOCAB).save_pretrained(TOKENIZER_DIR)


if __name__ == "__main__":
    write_assets()
    print(f"wrote {PROBLEMS_FILE} and {TOKENIZER_DIR}/")
