"""Prompt records for text tasks: GSM8K- and MATH-format JSONL, and reasoning_gym.

Every builder returns prompt records (see `prompts`) with a stable `prompt_id`,
`tokens` from the tokenizer's chat template (an optional system message, then the
question with an instruction appended, then the generation prompt), `question`,
`answer` (the final answer as a string), `verifier` (the name of the
`verifiers.VERIFIERS` entry that scores it) and whatever that verifier reads.
Records hold only JSON values, so they pickle, log and checkpoint as they are.

The tokenizer is anything with `apply_chat_template(messages, add_generation_prompt=True)`
returning token ids.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from dora_jax.data.prompts import DataError, Record, check_record, jsonl_objects
from dora_jax.rewards import verifiers
from dora_jax.text.tokenizer import TokenizerError

GSM8K_INSTRUCTION = ("Solve the problem step by step, then write the final answer as a "
                     "number on the last line, after \"####\".")
MATH_INSTRUCTION = "Solve the problem step by step, and put the final answer in \\boxed{}."
ANSWER_TAG_INSTRUCTION = "Give your final answer inside <answer></answer> tags."
# The instruction used when a caller passes none, by the answer format it asks for.
DEFAULT_INSTRUCTIONS = {"gsm8k": GSM8K_INSTRUCTION, "math": MATH_INSTRUCTION,
                        "countdown_expr": ANSWER_TAG_INSTRUCTION,
                        "reasoning_gym": ANSWER_TAG_INSTRUCTION}
# A final answer written as each default instruction asks (what a warm start imitates).
ANSWER_FORMATS = {"gsm8k": "#### {}", "math": "\\boxed{{{}}}",
                  "countdown_expr": "<answer>{}</answer>", "reasoning_gym": "<answer>{}</answer>"}
FORMATS = ("gsm8k", "math")


def chat_tokens(tokenizer, question: str, *, instruction: str | None = None,
                system_prompt: str | None = None) -> list[int]:
    """Token ids of a one-turn chat asking `question` (+ `instruction`), ready for
    the assistant's reply."""
    content = f"{question}\n\n{instruction}" if instruction else question
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": content})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return [int(t) for t in ids]


def make_record(tokenizer, prompt_id: str, question: str, answer: str, verifier: str, *,
                instruction: str | None = None, system_prompt: str | None = None,
                where: str | None = None, vocab_size: int | None = None,
                **extra: Any) -> Record:
    """One validated text-task record. `instruction=None` takes the verifier's
    default (DEFAULT_INSTRUCTIONS); pass "" for none."""
    if instruction is None:
        instruction = DEFAULT_INSTRUCTIONS.get(verifier, "")
    where = where or prompt_id
    try:
        tokens = chat_tokens(tokenizer, question, instruction=instruction,
                             system_prompt=system_prompt)
    except TokenizerError as e:  # the template failed on this record: name both
        raise DataError(f"{where}: {e}") from None
    record = {"prompt_id": prompt_id, "tokens": tokens, "question": question,
              "answer": answer, "verifier": verifier, **extra}
    return check_record(record, where, vocab_size)


# ------------------------------------------------------------------ JSONL (GSM8K / MATH)

def _string_field(obj: dict, key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: missing or empty string field {key!r}")
    return value


def _gsm8k_qa(obj: dict, where: str) -> tuple[str, str]:
    question = _string_field(obj, "question", where)
    solution = _string_field(obj, "answer", where)
    answer = verifiers.extract_gsm8k_answer(solution)
    if answer is None:
        raise DataError(f"{where}: 'answer' has no number after '####'")
    return question, answer


def _math_qa(obj: dict, where: str) -> tuple[str, str]:
    question = _string_field(obj, "problem", where)
    if "answer" in obj:
        answer = obj["answer"]
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str) or not answer.strip():
            raise DataError(f"{where}: 'answer' must be a non-empty string or a number")
        return question, answer.strip()
    answer = verifiers.extract_boxed(_string_field(obj, "solution", where))
    if not answer:
        raise DataError(f"{where}: 'solution' has no complete \\boxed{{...}} answer")
    return question, answer


def read_qa_jsonl(path: str, format: str) -> Iterator[tuple[str, str, str, str]]:
    """(where, prompt_id, question, answer) for each line of a GSM8K- or MATH-format
    JSONL file. `prompt_id` is the line's `id` field, else `<basename>:<line>`. A bad
    line (invalid JSON, a missing field, no final answer, a repeated id) raises
    DataError naming the file and line; an empty file raises too."""
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; known: {FORMATS}")
    parse = _gsm8k_qa if format == "gsm8k" else _math_qa
    base = os.path.basename(path)
    seen: dict[str, str] = {}
    for where, lineno, obj in jsonl_objects(path):
        question, answer = parse(obj, where)
        given = obj.get("id")
        if given is not None and (not isinstance(given, (str, int)) or isinstance(given, bool)):
            raise DataError(f"{where}: 'id' must be a string or an int, got "
                            f"{type(given).__name__}")
        prompt_id = str(given) if given is not None else f"{base}:{lineno}"
        if prompt_id in seen:
            raise DataError(f"{where}: prompt id {prompt_id!r} repeats {seen[prompt_id]}")
        seen[prompt_id] = where
        yield where, prompt_id, question, answer
    if not seen:
        raise DataError(f"{path}: no records")


def _jsonl_records(path, tokenizer, format, *, instruction, system_prompt, vocab_size):
    return [make_record(tokenizer, prompt_id, question, answer, format,
                        instruction=instruction, system_prompt=system_prompt, where=where,
                        vocab_size=vocab_size)
            for where, prompt_id, question, answer in read_qa_jsonl(path, format)]


def gsm8k_records(path: str, tokenizer, *, instruction: str | None = None,
                  system_prompt: str | None = None,
                  vocab_size: int | None = None) -> list[Record]:
    """Records from GSM8K-format JSONL (`question`, and `answer` ending `#### N`).

    Keys: prompt_id, tokens, question, answer (N as a string, commas removed),
    verifier ("gsm8k").
    """
    return _jsonl_records(path, tokenizer, "gsm8k", instruction=instruction,
                          system_prompt=system_prompt, vocab_size=vocab_size)


def math_records(path: str, tokenizer, *, instruction: str | None = None,
                 system_prompt: str | None = None,
                 vocab_size: int | None = None) -> list[Record]:
    """Records from MATH-format JSONL (`problem`, and an `answer` field or a
    `solution` with a `\\boxed{}` answer).

    Keys: prompt_id, tokens, question, answer (the explicit answer, else the last
    boxed content), verifier ("math").
    """
    return _jsonl_records(path, tokenizer, "math", instruction=instruction,
                          system_prompt=system_prompt, vocab_size=vocab_size)


# ------------------------------------------------------------------ reasoning_gym

def _json_friendly(value: Any) -> Any:
    # Metadata may hold tuples, sets or objects; only JSON values go in a record.
    return json.loads(json.dumps(value, default=repr))


def reasoning_gym_records(task: str, tokenizer, *, size: int, seed: int,
                          config: dict | None = None, instruction: str | None = None,
                          system_prompt: str | None = None, keep_metadata: bool = False,
                          vocab_size: int | None = None) -> list[Record]:
    """`size` records of a procedural reasoning_gym task (`config` goes to
    `reasoning_gym.create_dataset` as keyword arguments); the same task, size, seed
    and config give the same records.

    Keys: prompt_id (`rg-<task>-<seed>-<i>`), tokens, question, answer (the dataset's
    reference answer), verifier, rg_task, rg_seed, rg_size, rg_index, rg_config (what
    re-creates the entry the dataset's own scoring needs), and with keep_metadata the
    entry's metadata. "countdown" records also hold `numbers` and `target` and use the
    "countdown_expr" verifier; every other task uses "reasoning_gym" (the dataset's
    `score_answer`).
    """
    import reasoning_gym

    config = _json_friendly(dict(config or {}))
    dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **config)
    records = []
    for i in range(size):
        entry = dataset[i]
        extra: dict[str, Any] = {"rg_task": task, "rg_seed": seed, "rg_size": size,
                                 "rg_index": i, "rg_config": config}
        verifier = "reasoning_gym"
        if task == "countdown":
            verifier = "countdown_expr"
            extra["numbers"] = [int(n) for n in entry["metadata"]["numbers"]]
            extra["target"] = int(entry["metadata"]["target"])
        if keep_metadata:
            extra["metadata"] = _json_friendly(entry.get("metadata", {}))
        answer = entry.get("answer")
        records.append(make_record(
            tokenizer, f"rg-{task}-{seed}-{i}", entry["question"],
            None if answer is None else str(answer), verifier, instruction=instruction,
            system_prompt=system_prompt, vocab_size=vocab_size, **extra))
    return records

