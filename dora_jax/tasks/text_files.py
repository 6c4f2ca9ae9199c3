"""`gsm8k` and `math`: text prompts from GSM8K- or MATH-format JSONL (the reader is
data/text_records.read_qa_jsonl), scored by the verifier of the same name."""

from __future__ import annotations

from dora_jax.data.prompts import Record
from dora_jax.data.text_records import make_record, read_qa_jsonl
from dora_jax.tasks.base import Task, chat_tokenizer, register, text_options


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


@register
class Gsm8k(Task):
    name = "gsm8k"
    reward = "gsm8k"
    text = True
    needs = "path"

    def records(self, cfg, tokenizer=None) -> list[dict]:
        return gsm8k_records(cfg.data.path, chat_tokenizer(cfg, tokenizer),
                             **text_options(cfg))


@register
class Math(Task):
    name = "math"
    reward = "math"
    text = True
    needs = "path"

    def records(self, cfg, tokenizer=None) -> list[dict]:
        return math_records(cfg.data.path, chat_tokenizer(cfg, tokenizer),
                            **text_options(cfg))
