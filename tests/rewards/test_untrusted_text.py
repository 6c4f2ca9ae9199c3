"""Model text is untrusted: no verifier executes it, reads it in more than linear
time, or raises on it; refused reasoning_gym tasks never see it."""

import re
import sys
import time

import pytest
from _char_tokenizer import CharTokenizer

from dora_jax import config as config_lib
from dora_jax.model import hf_checks
from dora_jax.rewards import reasoning_gym_scores, verifiers
from dora_jax.tasks.reasoning_gym import reasoning_gym_records

TOK = CharTokenizer()
MARKER = "__pwn_marker__"

# An audit hook (they cannot be removed, so it is gated) that records, while armed,
# every execution of a code object built from marked text (eval and exec raise the
# `exec` event; `ast.parse` only compiles, so `compile` alone is no evidence) and
# every process start.
_seen: list | None = None


def _mentions_marker(code) -> bool:
    for item in (*code.co_consts, *code.co_names):
        if isinstance(item, str) and MARKER in item:
            return True
        if hasattr(item, "co_consts") and _mentions_marker(item):
            return True
    return False


def _audit(event, args):
    if _seen is None:
        return
    if event == "exec" and hasattr(args[0], "co_consts") and _mentions_marker(args[0]):
        _seen.append(("exec", args[0].co_filename))
    elif event in ("os.system", "subprocess.Popen", "os.posix_spawn", "os.exec"):
        _seen.append((event, str(args)[:120]))


sys.addaudithook(_audit)


def watched(fn, *args):
    """(fn's result or exception, the marked compilations and process starts)."""
    global _seen
    _seen = []
    try:
        result = fn(*args)
    except Exception as e:  # noqa: BLE001
        result = e
    finally:
        seen, _seen = _seen, None
    return result, seen


def payloads(tmp_path, answer: str = "1"):
    """A code payload in the shapes the scorers parse: bare, in lists, in arithmetic,
    in assignments, spliced into the right answer, in each answer format."""
    code = f"__import__('os').system('touch {tmp_path}/{MARKER}')"
    shapes = [code, f"{code} or [1]", f"[{code}]", f"[[{code}]]", f"({code})", f"1+{code}",
              f"x = {code}", f"{code} = 24", f"{{'a': {code}}}", f"{answer} {code}",
              answer.replace("1", code, 1), answer[: len(answer) // 2] + code]
    texts = []
    for s in shapes:
        texts += [s, f"<answer>{s}</answer>", f"\\boxed{{{s}}}", f"#### {s}", f"${s}$",
                  f"The final answer is {s}"]
    return texts


def test_the_watch_sees_code_run_from_text(tmp_path):
    """The detector below is not vacuous: sympy's parse_expr on a payload shows."""
    from sympy.parsing.sympy_parser import parse_expr

    _, seen = watched(parse_expr, f"{MARKER} + 1")
    assert seen and seen[0][0] == "exec"
    _, seen = watched(eval, f"'{MARKER}'")
    assert seen == [("exec", "<string>")]


def _scored_without_code(record, texts, tmp_path):
    for text in texts:
        result, seen = watched(verifiers.record_reward, record, text)
        assert not seen, (record.get("rg_task", record["verifier"]), text, seen)
        assert not isinstance(result, Exception), (text, result)
        assert result == 0.0, (text, result)
    assert not (tmp_path / MARKER).exists()


@pytest.mark.parametrize("record", [
    {"prompt_id": "g", "verifier": "gsm8k", "answer": "98765"},
    {"prompt_id": "m", "verifier": "math", "answer": "98765"},
    {"prompt_id": "c", "verifier": "countdown_expr", "numbers": [1, 2, 3], "target": 7},
], ids=lambda r: r["verifier"])
def test_no_verifier_runs_a_code_payload(record, tmp_path):
    _scored_without_code(record, payloads(tmp_path), tmp_path)


@pytest.mark.slow
def test_no_allowed_reasoning_gym_task_runs_a_code_payload(tmp_path):
    """Every allowed task, through its own scorer, with the payload in the shapes
    that reached eval or parse_expr in the refused ones (about 20 s)."""
    code = f"__import__('os').system('touch {tmp_path}/{MARKER}')"
    for task in sorted(reasoning_gym_scores.ALLOWED):
        [record] = reasoning_gym_records(task, TOK, size=1, seed=0)
        # The reasoning_gym verifier, whichever verifier the builder picked.
        record = {**record, "verifier": "reasoning_gym"}
        answer = str(record["answer"])
        for shape in [code, f"{code} or [1]", f"[[{code}]]", f"1+{code}", f"x = {code}",
                      f"{{'a': {code}}}", answer.replace("1", code, 1), f"{answer} {code}"]:
            result, seen = watched(verifiers.record_reward, record, f"<answer>{shape}</answer>")
            assert not seen, (task, shape, seen)
            assert isinstance(result, float), (task, shape, result)
    assert not (tmp_path / MARKER).exists()


@pytest.mark.parametrize("task", sorted(reasoning_gym_scores.REFUSED))
def test_refused_tasks_never_see_the_text(task, tmp_path):
    record = {"prompt_id": "r", "verifier": "reasoning_gym", "rg_task": task, "rg_seed": 0,
              "rg_size": 1, "rg_index": 0, "question": "q"}
    result, seen = watched(verifiers.record_reward, record,
                           f"<answer>{payloads(tmp_path)[0]}</answer>")
    assert isinstance(result, ValueError) and "refused" in str(result)
    assert not seen and not (tmp_path / MARKER).exists()


@pytest.mark.parametrize("task, named", [("spiral_matrix", "eval()"),
                                         ("simple_integration", "parse_expr"),
                                         ("a_task_from_a_later_release", "not one vetted")])
def test_config_refuses_unsafe_tasks_by_name(task, named, load_config):
    c = load_config("configs/tiny.py:spread", validate=False)
    c.data.source, c.data.task = "reasoning_gym", task
    with pytest.raises(config_lib.ConfigError, match=re.escape("config.data.task")) as e:
        hf_checks.validated(c)
    assert task in str(e.value) and named in str(e.value)


@pytest.mark.parametrize("task", sorted(reasoning_gym_scores.OWN_PARSER))
def test_own_parser_scores_the_reference_answer_and_nothing_else(task):
    [record] = reasoning_gym_records(task, TOK, size=1, seed=3)
    record = {**record, "verifier": "reasoning_gym"}
    answer = record["answer"]
    assert verifiers.record_reward(record, f"<answer>{answer}</answer>") == 1.0
    assert verifiers.record_reward(record, f"<answer>{answer} + 1</answer>") == 0.0
    assert verifiers.record_reward(record, f"<answer>({answer}) * 1 * 1</answer>") in (0.0, 1.0)


def test_puzzle24_needs_all_four_numbers():
    metadata = {"numbers": [4, 6, 1, 1]}
    assert reasoning_gym_scores.arithmetic_score("puzzle24", "4*6*1*1", metadata) == 1.0
    assert reasoning_gym_scores.arithmetic_score("puzzle24", "4*6", metadata) == 0.0
    assert reasoning_gym_scores.arithmetic_score("puzzle24", "4*6*1*1*1", metadata) == 0.0


# ------------------------------------------------------------------ linear time, no raise

_QUADRATIC = [
    ("<answer>" * 16384, "countdown_expr"),  # 128 KiB of opening tags
    ("<answer>" * 131072, "countdown_expr"),  # 1 MiB
    ("\\boxed{" * 131072, "gsm8k"),
    ("{" * 500_000 + "\\boxed{" + "{" * 500_000, "gsm8k"),
    ("1," * 500_000, "gsm8k"),
    ("9" * 1_000_000, "gsm8k"),
    ("\n" * 1_000_000, "countdown_expr"),
]


@pytest.mark.parametrize("text, verifier", _QUADRATIC, ids=range(len(_QUADRATIC)))
def test_degenerate_megabyte_responses_score_in_linear_time(text, verifier):
    record = {"prompt_id": "x", "verifier": verifier, "answer": "7", "numbers": [7],
              "target": 7}
    start = time.perf_counter()
    assert verifiers.record_reward(record, text) == 0.0
    # Linear: well under a second for a megabyte. The quadratic reading this replaced
    # took 55 s for 128 KiB of opening tags.
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("text", ["#### " + "1" * 4301, "\\boxed{" + "9" * 5000 + "}",
                                  "the answer is " + "1" * 100_000, "#### 1/0",
                                  "#### \u0664\u0662",  # Arabic-Indic 42: not read
                                  "#### \uff14\uff12", "#### 4\u200b2", "\x00" * 10])
def test_gsm8k_scores_any_text_without_raising(text):
    assert verifiers.gsm8k_reward({"answer": "42"}, text) == 0.0


def test_extraction_takes_the_last_answer():
    assert verifiers.extract_answer_tag("<answer>1</answer> <answer>2</answer>") == "2"
    assert verifiers.extract_answer_tag("<answer>a<answer>b</answer>") == "b"
    assert verifiers.extract_answer_tag("<answer>open only") is None
    assert verifiers.extract_boxed("\\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert verifiers.last_number("1, 2 and 3,000.5") == "3000.5"
