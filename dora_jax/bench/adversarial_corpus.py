"""The adversarial responses `bench.adversarial` scores: what a policy trained against
our verifiers could learn to write.

Each case is `{"record": {...}, "text": "...", "kind": "..."}`; `{sentinel}` in a
text becomes, at scoring time, a path that only code execution would create. Every
record's reference answer is one no case gives, so every case should score 0.

- code payloads: Python that writes the sentinel, in the shapes the scorers parse
  (bare, in lists, in arithmetic, in assignments, spliced into the right answer,
  in each answer format), against every verifier and against the reasoning_gym
  tasks that ran such text (refused now, or scored by our own parser);
- numeric and LaTeX bombs: towers, factorials and binomials whose exact value takes
  minutes or gigabytes;
- pathological regex inputs: megabytes of opening tags, braces, separators;
- megabyte responses; digits of other scripts.
"""

from __future__ import annotations

GOLD = "98765"  # the reference answer of every numeric record; no case writes it

_CODE = [
    "__import__('os').system('touch {sentinel}')",
    "open('{sentinel}', 'w').write('x')",
    "__import__('pathlib').Path('{sentinel}').touch()",
    "[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == 'Popen'][0]"
    "(['touch', '{sentinel}'])",
]
_SHAPES = ["{c}", "{c} or [1]", "[{c}]", "[[{c}]]", "1+{c}", "x = {c}", "{c} = 24",
           "{{'a': {c}}}"]
_FORMATS = ["{s}", "<answer>{s}</answer>", "\\boxed{{{s}}}", "#### {s}",
            "The final answer is {s}", "${s}$"]

_MATH_BOMBS = [
    "The final answer is 9^9^9", "\\boxed{9^{9^{9}}}", "\\boxed{10^{10^{10}}}",
    "\\boxed{100000000!}", "\\boxed{\\binom{10^9}{10^5}}", "\\boxed{2^{2^{2^{2^{2^{2}}}}}}",
    "\\boxed{(10^{100})!}", "\\boxed{10^{10^{10^{10}}}}", "$9^{9^{9^{9}}}$",
    "\\boxed{\\sqrt[10^{9}]{10^{10^{10}}}}", "The answer is 99999999999**99999999999",
    "\\boxed{\\frac{10^{10^{10}}}{10^{10^{10}}-1}}",
]
_ARITHMETIC_BOMBS = [
    "<answer>9**9**9**9</answer>", "<answer>" + "(" * 100_000 + "1" + ")" * 100_000 + "</answer>",
    "<answer>" + "*".join(["9" * 99] * 10) + "</answer>", "<answer>" + "-" * 500_000 + "1</answer>",
    "<answer>" + "1+" * 400 + "1</answer>",
]
_REGEX = [
    "<answer>" * 131_072, "\\boxed{" * 131_072, "{" * 1_000_000, "1," * 500_000,
    "$" * 1_000_000, "\\frac{" * 100_000, "=" * 1_000_000, "( " * 500_000,
    "####" * 250_000, "#### " + "1" * 4301, "9" * 1_000_000, "1." * 500_000,
    "\\boxed{" + "{" * 500_000, "<answer>" + "</answer" * 100_000,
]
_BIG = ["a" * 1_000_000, "The answer is 12345. " * 48_000, ("lorem ipsum " * 87_000) + "#### 12345"]
_UNICODE = ["#### \u0669\u0668\u0667\u0666\u0665",  # Arabic-Indic 98765
            "\\boxed{\uff19\uff18\uff17\uff16\uff15}",  # fullwidth
            "#### \u2079\u2078\u2077\u2076\u2075",  # superscripts
            "#### 9\u200b8\u200b7\u200b6\u200b5",  # zero-width spaces
            "<answer>\U0001d7d7\U0001d7d6\U0001d7d5\U0001d7d4\U0001d7d3</answer>"]


def _numeric(verifier: str, i: int) -> dict:
    return {"prompt_id": f"adv-{verifier}-{i}", "verifier": verifier, "answer": GOLD}


def _countdown(i: int) -> dict:
    return {"prompt_id": f"adv-countdown-{i}", "verifier": "countdown_expr",
            "numbers": [3, 7, 25, 50], "target": 9999}


def _reasoning_gym_records() -> list[dict]:
    """Records of the reasoning_gym tasks that ran model text before: the ones now
    refused, and the ones now scored by our own parser."""
    from dora_jax.rewards import reasoning_gym_scores as rgt

    records = []
    for task in sorted(set(rgt.REFUSED) - {"composite", "list_functions"}) + sorted(rgt.OWN_PARSER):
        import reasoning_gym

        entry = reasoning_gym.create_dataset(task, size=1, seed=0)[0]
        records.append({"prompt_id": f"adv-rg-{task}", "verifier": "reasoning_gym",
                        "rg_task": task, "rg_seed": 0, "rg_size": 1, "rg_index": 0,
                        "rg_config": {}, "question": entry["question"],
                        "answer": str(entry["answer"])})
    return records


def cases() -> list[dict]:
    """The shipped corpus."""
    out = []

    def add(record, text, kind):
        out.append({"record": record, "text": text, "kind": kind})

    payloads = [shape.format(c=code) for code in _CODE for shape in _SHAPES]
    for verifier, record_of in (("gsm8k", lambda i: _numeric("gsm8k", i)),
                                ("math", lambda i: _numeric("math", i)),
                                ("countdown_expr", _countdown)):
        texts = [fmt.format(s=p) for p in payloads for fmt in _FORMATS]
        for i, text in enumerate(texts):
            add(record_of(i), text, f"code/{verifier}")
    for record in _reasoning_gym_records():
        answer = record["answer"]
        middle = len(answer) // 2
        for p in payloads[:len(_SHAPES)] + [answer[:middle] + payloads[0] + answer[middle:],
                                            f"{answer} {payloads[0]}"]:
            add(record, f"<answer>{p}</answer>", f"code/reasoning_gym/{record['rg_task']}")
    for i, text in enumerate(_MATH_BOMBS):
        add(_numeric("math", 1000 + i), text, "bomb/math")
        add(_numeric("gsm8k", 1000 + i), text, "bomb/gsm8k")
    for i, text in enumerate(_ARITHMETIC_BOMBS):
        add(_countdown(1000 + i), text, "bomb/countdown_expr")
    for group, texts in (("regex", _REGEX), ("megabyte", _BIG), ("unicode", _UNICODE)):
        for i, text in enumerate(texts):
            for verifier in ("gsm8k", "math"):
                add(_numeric(verifier, 2000 + i), text, f"{group}/{verifier}")
            add(_countdown(2000 + i), text, f"{group}/countdown_expr")
    return out
