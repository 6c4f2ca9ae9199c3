"""Text-task record builders (GSM8K/MATH JSONL, reasoning_gym) and the local TFDS
build, with a character-level tokenizer so the prompts can be read back."""

import json
import os
import pickle
import subprocess
import sys

import pytest
from _char_tokenizer import BOS, CharTokenizer

from dora_jax.data import prompts, text_records
from dora_jax.rewards import verifiers
from dora_jax.tasks.reasoning_gym import reasoning_gym_records
from dora_jax.tasks.text_files import gsm8k_records, math_records

TOK = CharTokenizer()

GSM8K_LINES = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A car costs $1,200 and a bike $34. Total?",
     "answer": "1200 + 34 = 1234\n#### 1,234", "id": "gsm-big"},
    {"question": "Half of 9?", "answer": "#### 4.5"},
]


def write_jsonl(path, lines):
    with open(path, "w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return str(path)


def prompt_text(record):
    assert record["tokens"][0] == BOS
    return TOK.decode(record["tokens"])


# ------------------------------------------------------------------ GSM8K

def test_gsm8k_records(tmp_path):
    path = write_jsonl(tmp_path / "gsm.jsonl", GSM8K_LINES[:1] + [""] + GSM8K_LINES[1:])
    records = gsm8k_records(path, TOK)
    # Line numbers count the blank line; an explicit id wins.
    assert [r["prompt_id"] for r in records] == ["gsm.jsonl:1", "gsm-big", "gsm.jsonl:4"]
    assert [r["answer"] for r in records] == ["7", "1234", "4.5"]
    assert [r["question"] for r in records] == [x["question"] for x in GSM8K_LINES]
    assert all(r["verifier"] == "gsm8k" for r in records)
    assert prompt_text(records[0]) == (
        "user: Tom has 3 apples and buys 4. How many?\n\n"
        + text_records.GSM8K_INSTRUCTION + "\nassistant: ")
    assert records == gsm8k_records(path, TOK)
    assert json.loads(json.dumps(records)) == records


def test_gsm8k_records_system_prompt_and_instruction(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", GSM8K_LINES[:1])
    [r] = gsm8k_records(path, TOK, system_prompt="Be brief.",
                                   instruction="Put the final answer after ####.")
    assert prompt_text(r) == ("system: Be brief.\nuser: Tom has 3 apples and buys 4. How many?"
                              "\n\nPut the final answer after ####.\nassistant: ")
    [bare] = gsm8k_records(path, TOK, instruction="")
    assert prompt_text(bare) == "user: Tom has 3 apples and buys 4. How many?\nassistant: "


@pytest.mark.parametrize("bad_line, why", [
    ('{"question": "q", "answer": "#### 3"', "not valid JSON"),
    ('["question", "answer"]', "expected a JSON object"),
    ('{"answer": "#### 3"}', "'question'"),
    ('{"question": "q"}', "'answer'"),
    ('{"question": "q", "answer": "three"}', "no number after '####'"),
    ('{"question": "q", "answer": "####"}', "no number after '####'"),
    ('{"question": "", "answer": "#### 3"}', "'question'"),
    ('{"question": "q", "answer": "#### 3", "id": "gsm-big"}', "repeats"),
])
def test_gsm8k_bad_line_names_file_and_line(tmp_path, bad_line, why):
    path = write_jsonl(tmp_path / "bad.jsonl", GSM8K_LINES[:2] + [bad_line])
    with pytest.raises(prompts.DataError, match=why) as e:
        gsm8k_records(path, TOK)
    assert f"{path}:3:" in str(e.value)


def test_empty_file_and_vocab_size_are_checked(tmp_path):
    with pytest.raises(prompts.DataError, match="no records"):
        gsm8k_records(write_jsonl(tmp_path / "empty.jsonl", ["", ""]), TOK)
    path = write_jsonl(tmp_path / "g.jsonl", GSM8K_LINES[:1])
    # 'y' (121) is the largest character here: id 125.
    with pytest.raises(prompts.DataError, match="vocab_size 100"):
        gsm8k_records(path, TOK, vocab_size=100)
    assert gsm8k_records(path, TOK, vocab_size=200)


def test_gsm8k_record_scores_through_the_token_reward(tmp_path):
    [r] = gsm8k_records(write_jsonl(tmp_path / "g.jsonl", GSM8K_LINES[1:2]), TOK)
    reward = verifiers.token_reward(verifiers.text_reward(r["verifier"]), TOK)
    assert reward(r, TOK.encode("1200 + 34\n#### 1234") + [TOK.eos_id]) == 1.0
    assert reward(r, TOK.encode("#### 1200") + [TOK.eos_id]) == 0.0


# ------------------------------------------------------------------ MATH

def test_math_records(tmp_path):
    lines = [
        {"problem": "Simplify 2/4.", "solution": r"It is $\boxed{\frac{1}{2}}$."},
        {"problem": "Two boxes?", "solution": r"Not \boxed{1} but \boxed{x^{2}}."},
        {"problem": "Explicit.", "solution": r"\boxed{9}", "answer": "3"},
        {"problem": "Numeric.", "answer": 12, "id": 7},
    ]
    records = math_records(write_jsonl(tmp_path / "m.jsonl", lines), TOK)
    assert [r["answer"] for r in records] == [r"\frac{1}{2}", "x^{2}", "3", "12"]
    assert [r["prompt_id"] for r in records] == ["m.jsonl:1", "m.jsonl:2", "m.jsonl:3", "7"]
    assert all(r["verifier"] == "math" for r in records)
    assert prompt_text(records[0]).endswith(text_records.MATH_INSTRUCTION + "\nassistant: ")
    assert verifiers.math_reward(records[0], r"\boxed{0.5}") == 1.0


@pytest.mark.parametrize("bad_line, why", [
    ('{"problem": "p", "solution": "no box"}', "no complete"),
    ('{"problem": "p", "solution": "\\\\boxed{1"}', "no complete"),
    ('{"solution": "\\\\boxed{1}"}', "'problem'"),
    ('{"problem": "p"}', "'solution'"),
    ('{"problem": "p", "answer": ""}', "'answer'"),
])
def test_math_bad_line_names_file_and_line(tmp_path, bad_line, why):
    path = write_jsonl(tmp_path / "m.jsonl", [{"problem": "p", "answer": "1"}, bad_line])
    with pytest.raises(prompts.DataError, match=why) as e:
        math_records(path, TOK)
    assert f"{path}:2:" in str(e.value)


# ------------------------------------------------------------------ reasoning_gym

def test_basic_arithmetic_records_are_deterministic_and_verifiable():
    import reasoning_gym

    a = reasoning_gym_records("basic_arithmetic", TOK, size=6, seed=11)
    assert a == reasoning_gym_records("basic_arithmetic", TOK, size=6, seed=11)
    other = reasoning_gym_records("basic_arithmetic", TOK, size=6, seed=12)
    assert [r["question"] for r in other] != [r["question"] for r in a]
    assert [r["prompt_id"] for r in a] == [f"rg-basic_arithmetic-11-{i}" for i in range(6)]
    ds = reasoning_gym.create_dataset("basic_arithmetic", size=6, seed=11)
    assert [r["answer"] for r in a] == [ds[i]["answer"] for i in range(6)]
    assert json.loads(json.dumps(a)) == a and pickle.loads(pickle.dumps(a)) == a
    for r in a:
        assert r["verifier"] == "reasoning_gym"
        assert r["question"] in prompt_text(r)
        answered = f"Working...\n<answer>{r['answer']}</answer>"
        assert verifiers.reasoning_gym_reward(r, answered) == 1.0
        assert verifiers.reasoning_gym_reward(r, r["answer"]) == 1.0  # the last line
        wrong = str(int(float(r["answer"])) + 1)
        assert verifiers.reasoning_gym_reward(r, f"<answer>{wrong}</answer>") == 0.0


def test_reasoning_gym_config_travels_to_the_verifier():
    records = reasoning_gym_records(
        "basic_arithmetic", TOK, size=4, seed=3,
        config={"min_terms": 2, "max_terms": 2, "operators": ("+",)})
    assert records[0]["rg_config"]["operators"] == ["+"]
    for r in records:
        assert r["question"].count("+") >= 1 and "*" not in r["question"]
        # The verifier re-creates the same entry only with the same config.
        assert verifiers.reasoning_gym_reward(r, f"<answer>{r['answer']}</answer>") == 1.0


def test_countdown_records_score_with_the_safe_evaluator():
    records = reasoning_gym_records("countdown", TOK, size=4, seed=5)
    assert records == reasoning_gym_records("countdown", TOK, size=4, seed=5)
    for r in records:
        assert r["verifier"] == "countdown_expr"
        assert all(str(n) in r["question"] for n in r["numbers"])
        assert str(r["target"]) in r["question"]
        assert verifiers.countdown_reward(r, f"<answer>{r['answer']}</answer>") == 1.0
        assert verifiers.countdown_reward(r, f"<answer>{r['answer']} + 1</answer>") == 0.0
        twice = f"{r['numbers'][0]} + {r['numbers'][0]} - {r['numbers'][0]}"
        if r["numbers"].count(r["numbers"][0]) == 1:
            assert verifiers.countdown_reward(
                {**r, "target": r["numbers"][0]}, twice) == 0.0
        # The dataset's own scoring agrees on its reference answer.
        assert verifiers.reasoning_gym_reward(r, f"<answer>{r['answer']}</answer>") == 1.0


def test_any_reasoning_gym_task_scores_through_its_dataset():
    records = reasoning_gym_records("leg_counting", TOK, size=3, seed=2,
                                               keep_metadata=True)
    for r in records:
        assert r["metadata"]["total_legs"] == int(r["answer"])
        assert verifiers.reasoning_gym_reward(r, f"<answer>{r['answer']}</answer>") == 1.0
        assert verifiers.reasoning_gym_reward(r, "<answer>-1</answer>") == 0.0


def test_reasoning_gym_record_that_does_not_match_raises():
    [r] = reasoning_gym_records("chain_sum", TOK, size=1, seed=0)
    with pytest.raises(ValueError, match="different question"):
        verifiers.reasoning_gym_reward({**r, "question": "tampered"}, r["answer"])


def test_a_remade_entry_is_made_once_and_never_shared():
    """Scoring re-makes a record's entry from its seed and index once (a group's
    samples share it); each caller gets its own copy, so a scorer that changed one
    could not change what the next response is scored against."""
    from dora_jax.rewards import reasoning_gym_scores

    [r] = reasoning_gym_records("chain_sum", TOK, size=1, seed=5)
    first = reasoning_gym_scores.entry(r)
    first["metadata"]["tampered"] = True
    first["answer"] = "-1"
    second = reasoning_gym_scores.entry(r)
    assert second is not first and "tampered" not in second["metadata"]
    assert second["answer"] == r["answer"]
    assert verifiers.reasoning_gym_reward(r, f"<answer>{r['answer']}</answer>") == 1.0


def test_reasoning_gym_rewards_in_the_reward_pool():
    from dora_jax.rewards.pool import RewardPool

    records = reasoning_gym_records("chain_sum", TOK, size=8, seed=4)
    pool = RewardPool(verifiers.token_reward(verifiers.record_reward, TOK),
                      num_workers=2, timeout=60)
    try:
        futures = [pool.submit(r, TOK.encode(f"<answer>{r['answer']}</answer>")) for r in records]
        assert [f.result(60) for f in futures] == [(1.0, None)] * len(records)
    finally:
        pool.close()


# ------------------------------------------------------------------ TFDS (local build)

def test_tfds_build_reads_back_the_jsonl_records(tmp_path):
    from dora_jax.data import tfds_local

    train = write_jsonl(tmp_path / "train.jsonl", GSM8K_LINES)
    test = write_jsonl(tmp_path / "test.jsonl", GSM8K_LINES[1:])
    data_dir = str(tmp_path / "tfds")
    name = tfds_local.prepare({"train": train, "test": test}, data_dir, name="gsm")
    assert name == "jsonl_qa/gsm"
    assert any(f.endswith(".array_record-00000-of-00001")
               for f in os.listdir(os.path.join(data_dir, "jsonl_qa", "gsm", "1.0.0")))
    for split, path in [("train", train), ("test", test)]:
        source = tfds_local.tfds_records(name, split, data_dir, TOK)
        assert [source[i] for i in range(len(source))] == gsm8k_records(path, TOK)

    # An existing build is reused unless overwritten.
    write_jsonl(train, GSM8K_LINES[:1])
    tfds_local.prepare(train, data_dir, name="gsm")
    assert len(tfds_local.tfds_records(name, "train", data_dir, TOK)) == 3
    tfds_local.prepare(train, data_dir, name="gsm", overwrite=True)
    assert len(tfds_local.tfds_records(name, "train", data_dir, TOK)) == 1


def test_tfds_math_build_and_bad_line(tmp_path):
    from dora_jax.data import tfds_local

    lines = [{"problem": "Simplify 2/4.", "solution": r"$\boxed{\frac{1}{2}}$"}]
    path = write_jsonl(tmp_path / "MATH-test.jsonl", lines)
    name = tfds_local.prepare(path, str(tmp_path), format="math")
    assert name == "jsonl_qa/math_test"
    source = tfds_local.tfds_records(name, "train", str(tmp_path), TOK)
    assert [source[i] for i in range(len(source))] == math_records(path, TOK)
    bad = write_jsonl(tmp_path / "bad.jsonl", [lines[0], '{"problem": "p"}'])
    with pytest.raises(prompts.DataError, match=f"{bad}:2:"):
        tfds_local.prepare(bad, str(tmp_path / "other"), format="math")


def test_tfds_records_reduce_solution_form_answers():
    from dora_jax.data import tfds_local

    examples = [{"question": b"q1", "answer": b"2 + 2\n#### 4"},
                {"question": b"q2", "answer": b"no final answer"}]
    source = tfds_local.tfds_records("gsm8k", "test", None, TOK, source=examples)
    r = source[0]
    assert (r["prompt_id"], r["answer"], r["verifier"]) == ("gsm8k/test:0", "4", "gsm8k")
    with pytest.raises(prompts.DataError, match=r"gsm8k/test\[1\]"):
        source[1]


@pytest.mark.slow
def test_tfds_command_line(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", GSM8K_LINES)
    test = write_jsonl(tmp_path / "test.jsonl", GSM8K_LINES[:1])
    data_dir = str(tmp_path / "tfds")
    out = subprocess.run(
        [sys.executable, "-m", "dora_jax.data.tfds_local", f"--jsonl={train}",
         f"--jsonl=test={test}", f"--data_dir={data_dir}", "--name=gsm"],
        capture_output=True, text=True, timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    assert f"jsonl_qa/gsm in {data_dir}: train=3, test=1" in out.stdout
    from dora_jax.data import tfds_local

    source = tfds_local.tfds_records("jsonl_qa/gsm", "train", data_dir, TOK)
    assert [source[i]["answer"] for i in range(len(source))] == ["7", "1234", "4.5"]
