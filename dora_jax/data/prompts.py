"""Prompt sources as Grain datasets: in-memory records, JSONL files, TFDS.

A prompt record is a dict with at least `prompt_id` (stable across epochs and runs)
and `tokens` (list of ints, the tokenised prompt); any other keys (an answer, a task
parameter) travel with it to the reward function. The stream shuffles with a seed,
reshuffles every epoch, tags each prompt with its epoch, and exposes Grain's iterator
state so a run can resume without repeating or skipping a prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import grain

from dora_jax.base import untrusted_files

Record = dict[str, Any]
# Token ids travel as int32 (no vocabulary comes near 2**31).
_MAX_TOKEN_ID = 2 ** 31 - 1


class DataError(ValueError):
    """A prompt record is malformed; the message says which record and why."""


def _short(value) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


def check_record(record: Record, where: str, vocab_size: int | None = None) -> Record:
    """Validates one prompt record; raises DataError naming `where`."""
    if "prompt_id" not in record:
        raise DataError(f"{where}: missing 'prompt_id'")
    prompt_id = record["prompt_id"]
    # An id keys the ledger and a resume's lookup: a string or an int, never a bool
    # (True == 1 would make two ids one).
    if not isinstance(prompt_id, (str, int)) or isinstance(prompt_id, bool):
        raise DataError(f"{where}: 'prompt_id' must be a string or an int, got "
                        f"{_short(prompt_id)}")
    tokens = record.get("tokens")
    if not isinstance(tokens, (list, tuple)) or not tokens:
        raise DataError(f"{where}: 'tokens' must be a non-empty list of ints, got "
                        f"{_short(tokens)}")
    for i, t in enumerate(tokens):
        # JSON true/false are Python ints: refused, not read as ids 1 and 0.
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise DataError(f"{where}: 'tokens'[{i}] is {_short(t)}, not a non-negative int")
        if vocab_size is not None and t >= vocab_size:
            raise DataError(f"{where}: 'tokens'[{i}] is {t}, not below vocab_size {vocab_size}")
        if t > _MAX_TOKEN_ID:  # with no vocab_size to check: would overflow int32 later
            raise DataError(f"{where}: 'tokens'[{i}] is {_short(t)}, over {_MAX_TOKEN_ID}")
    return record


def check_unique(records: Sequence[Record], wheres: Sequence[str] | None = None) -> None:
    """Refuses two records with one prompt_id (a resume finds a prompt by its id, so
    a repeat would silently stand for the other), naming both places: `wheres[i]`
    says where record i came from (default: `record i`)."""
    first: dict = {}
    for i, record in enumerate(records):
        where = wheres[i] if wheres is not None else f"record {i}"
        prompt_id = record["prompt_id"]
        if prompt_id in first:
            raise DataError(f"{where}: prompt_id {prompt_id!r} repeats the one at "
                            f"{first[prompt_id]}")
        first[prompt_id] = where


def jsonl_objects(path: str) -> Iterator[tuple[str, int, dict]]:
    """(where, line number, object) for each non-blank line of a JSONL file; a line
    that is not UTF-8 or not a JSON object raises DataError naming `<path>:<line>`."""
    try:
        # Streamed from a regular file, each line capped (untrusted_files): a FIFO or a
        # link to /dev/zero is one line, never a hang or a read without end.
        numbered = untrusted_files.lines(path, error=DataError)
        for lineno, raw in numbered:
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at "
                                f"column {e.start + 1})") from None
            if lineno == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark some editors write
            if not line.strip():
                continue
            # Nesting and integer digits bounded: a 100k-deep line or a token id of
            # thousands of digits names its line.
            obj = untrusted_files.loads(line, where, error=DataError)
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object")
            yield where, lineno, obj
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None


def read_jsonl(path: str, tokenize: Callable[[str], list[int]] | None = None,
               vocab_size: int | None = None) -> list[Record]:
    """Reads prompt records from a JSONL file.

    Each line is an object with `tokens`, or with `text` and a `tokenize` function.
    `prompt_id` defaults to `<file>:<line>`. A bad line raises DataError naming the
    file and line: bad data is reported, never silently skipped.
    """
    records, wheres = [], []
    for where, _, record in jsonl_objects(path):
        if "tokens" not in record and "text" in record:
            if tokenize is None:
                raise DataError(f"{where}: has 'text' but no tokenizer was given")
            if not isinstance(record["text"], str):
                raise DataError(f"{where}: 'text' must be a string, got "
                                f"{_short(record['text'])}")
            record["tokens"] = list(tokenize(record["text"]))
        record.setdefault("prompt_id", where)
        records.append(check_record(record, where, vocab_size))
        wheres.append(where)
    if not records:
        raise DataError(f"{path}: no prompt records")
    check_unique(records, wheres)
    return records


class TfdsSource:
    """Random access over a TFDS `data_source`, mapped to prompt records.

    `to_record(example, index)` turns one TFDS example into a prompt record. The
    dataset must already be prepared in `data_dir` (nothing is downloaded).
    """

    def __init__(self, name: str, split: str, to_record: Callable[[dict, int], Record],
                 data_dir: str | None = None, source=None):
        if source is None:
            import tensorflow_datasets as tfds

            source = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
        self._source = source
        self._to_record = to_record
        self._name = f"{name}/{split}"

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> Record:
        return check_record(self._to_record(self._source[index], index),
                            f"{self._name}[{index}]")


def prompt_dataset(source: Sequence[Record], *, seed: int, shuffle: bool = True,
                   num_epochs: int | None = None) -> grain.MapDataset:
    """A Grain MapDataset of prompt records, reshuffled per epoch, tagged with `epoch`.

    `num_epochs=None` repeats forever.
    """
    n = len(source)
    if n == 0:
        raise DataError("prompt source is empty")
    ds = grain.MapDataset.source(source)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs)
    return ds.map_with_index(lambda i, record: {**record, "epoch": i // n})


class PromptStream:
    """The next prompt on demand, with Grain's checkpointable iterator state."""

    def __init__(self, dataset: grain.MapDataset):
        # Read in the caller's thread: a prompt is wanted one at a time, at admission,
        # and a prefetching pool's hand-off costs the coordinator more than the read
        # (~0.1 ms against ~0.6 ms per prompt); the iterator state is the same.
        self._iter = iter(dataset.to_iter_dataset(
            grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))

    def next(self) -> Record | None:
        """The next prompt, or None once a finite dataset is exhausted."""
        try:
            return next(self._iter)
        except StopIteration:
            return None

    def get_state(self) -> dict:
        return self._iter.get_state()

    def set_state(self, state: dict) -> None:
        self._iter.set_state(state)


def in_memory(records: Iterable[Record], vocab_size: int | None = None) -> list[Record]:
    """Validates in-memory records (e.g. from a generator) into a list source."""
    out = [check_record(dict(r), f"record {i}", vocab_size) for i, r in enumerate(records)]
    check_unique(out)
    return out
