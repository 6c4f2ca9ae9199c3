"""Our Tokenizer behind JetStream's tokenizer protocol (`tokenizer_api.Tokenizer`):
what its server and `token_utils` read (`encode` returning padded tokens and their
true length, `decode` of streamed ids, `pad_id`, `eos_id`, `bos_id`, `stop_tokens`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dora_jax.text.tokenizer import Tokenizer


class ServingTokenizer:
    """`tokenizer` for a server. `pad(ids) -> (padded, true length)` pads to the
    engine's buckets; `stop_ids` (the engine's) are the `stop_tokens`. Everything
    else (apply_chat_template, vocab_size, ...) is the wrapped tokenizer's."""

    def __init__(self, tokenizer: Tokenizer, stop_ids, pad: Callable, max_length: int):
        self.tokenizer, self.stop_ids = tokenizer, tuple(stop_ids)
        self._pad, self._max_length = pad, max_length

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def encode(self, s: str, *, is_bos: bool = True, max_prefill_length: int | None = None,
               **_) -> tuple[np.ndarray, int]:
        """(ids of `s` padded to the engine's bucket, their count). `is_bos` prepends
        the BOS token, where the tokenizer has one. A text longer than
        `max_prefill_length` keeps its last tokens, as JetStream's tokenizers do.
        `prefill_lengths` and `jax_padding` are accepted and unused: the padding is
        the engine's, on the host."""
        ids = self.tokenizer.encode(s)
        if is_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]
        ids = ids[-min(max_prefill_length or self._max_length, self._max_length):]
        return self._pad(ids)

    def decode(self, token_ids, **_) -> str:
        return self.tokenizer.decode(token_ids)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def bos_id(self) -> int | None:
        return self.tokenizer.bos_id

    @property
    def stop_tokens(self) -> set[int]:
        return set(self.stop_ids)
