"""The text task's prompt record, and the reader of GSM8K- and MATH-format JSONL.

A text record (`make_record`; dora_jax/tasks builds them, and the TFDS reader here)
has a stable `prompt_id`, `tokens` from the tokenizer's chat template (an optional
system message, then the question with an instruction appended, then the generation
prompt), `question`, `answer` (the final answer as a string), `verifier` (the name of
the `verifiers.VERIFIERS` entry that scores it) and whatever that verifier reads.
Records hold only JSON values, so they pickle, log and checkpoint as they are.

The tokenizer is anything with `apply_chat_template(messages, add_generation_prompt=True)`
returning token ids.
"""

from __future__ import annotations

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


def make_record(tokenizer, prompt_id: str, question: str, answer: str | None,
                verifier: str, *,
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
