"""Which reasoning_gym tasks may score model text, and scoring them.

A task's own `score_answer` runs on the policy's answer, and several of them hand that
text to Python: `eval` (binary_matrix, spiral_matrix, n_queens, string_insertion) or
sympy's `parse_expr`, which is `eval` behind a tokenizer (countdown, puzzle24, the
integration tasks, polynomial_multiplication). A policy trained on such a reward
learns to run code next to the job. So tasks are allowed by name (the table is
config/vetted_tasks.py, below the rewards): each one there was read and probed (a
code payload in many shapes through its `score_answer`, with an audit hook watching
every `compile` and process start) for the version in
`VETTED_VERSION`; countdown and puzzle24 are scored by our own arithmetic parser
instead (`expressions.safe_arithmetic`); the rest are refused, with their reason, when
the config is validated. Two more are refused for what their scoring does with any
text: game_of_life_halting gives every non-empty answer full credit, and
list_functions cannot re-create its entries from their seed, which scoring relies on.
Several allowed tasks give small format credit to a wrong answer (0.01-0.25: e.g.
propositional_logic, spell_backward, palindrome_generation); that is their reward
design, recorded here so that it is not mistaken for a hole. Tasks added by a later
release stay refused until vetted.
"""

from __future__ import annotations

import collections
import copy
import json
import threading
from fractions import Fraction
from typing import Any

from dora_jax.config.vetted_tasks import (  # noqa: F401 - the vetting table, read by name
    ALLOWED,
    OWN_PARSER,
    REFUSED,
    VETTED_VERSION,
    refusal,
)
from dora_jax.rewards.expressions import literals_used, safe_arithmetic


def check_task(task: str) -> None:
    """Raises ValueError naming the reason if `task` may not score model text."""
    reason = refusal(task)
    if reason is not None:
        raise ValueError(reason)


def check_version() -> None:
    """Raises ValueError unless the installed reasoning-gym is the vetted release: a
    task's scoring may change between releases."""
    from importlib import metadata

    installed = metadata.version("reasoning-gym")
    if installed != VETTED_VERSION:
        raise ValueError(f"reasoning-gym {installed} is installed, but its tasks' scoring "
                         f"was vetted for {VETTED_VERSION} (pip install "
                         f"reasoning-gym=={VETTED_VERSION})")


_lock = threading.Lock()
_datasets: dict[tuple, Any] = {}
# Entries made from their seed and index, most recently used last: a group's samples
# score against the same entry, and some generators take seconds to make one
# (knight_swap and quantum_lock search for their solutions).
_entries: collections.OrderedDict[tuple, dict] = collections.OrderedDict()
_MAX_ENTRIES = 1024


def dataset(record: dict):
    """The record's reasoning_gym dataset (`rg_task`, `rg_seed`, `rg_size`,
    `rg_config`), cached; a refused task or another release raises ValueError."""
    key = _dataset_key(record)
    with _lock:
        if key not in _datasets:
            check_version()
            import reasoning_gym

            task, seed, size, _ = key
            config = record.get("rg_config") or {}
            _datasets[key] = reasoning_gym.create_dataset(task, size=size, seed=seed, **config)
        return _datasets[key]


def _dataset_key(record: dict) -> tuple:
    """(task, seed, size, config as JSON); a refused task raises ValueError."""
    task, seed, size = record["rg_task"], record["rg_seed"], record["rg_size"]
    check_task(task)
    config = record.get("rg_config") or {}
    return task, seed, size, json.dumps(config, sort_keys=True)


def entry(record: dict) -> dict:
    """The reasoning_gym entry a record was made from, re-created from its seed and
    index, so that scoring never trusts what a record file says the answer is."""
    ds = dataset(record)
    key = (_dataset_key(record), record["rg_index"])
    with _lock:  # generators are not known to be thread-safe
        made = _entries.get(key)
        if made is None:
            made = _entries[key] = ds[record["rg_index"]]
            if len(_entries) > _MAX_ENTRIES:
                _entries.popitem(last=False)
        else:
            _entries.move_to_end(key)
    # A copy: a task's scorer must not change the entry the next response scores on.
    made = copy.deepcopy(made)
    if made["question"] != record["question"]:
        raise ValueError(f"{record.get('prompt_id')!r}: the installed reasoning_gym makes a "
                         "different question for this seed and index than the record holds")
    return made


def arithmetic_score(task: str, answer: str, metadata: dict) -> float:
    """Our own scoring of countdown and puzzle24: 1.0 iff `answer` is an arithmetic
    expression (integers, + - * /, parentheses) over the entry's numbers that reaches
    the target exactly (countdown: each number at most as often as given; puzzle24:
    all four numbers, each once, making 24); else 0.0."""
    numbers = [int(n) for n in metadata["numbers"]]
    value = safe_arithmetic(answer, numbers)
    if value is None:
        return 0.0
    if task == "puzzle24":
        return float(value == 24 and sorted(literals_used(answer)) == sorted(numbers))
    return float(value == Fraction(int(metadata["target"])))


def score(record: dict, answer: str) -> float:
    """The record's task score of `answer` (already extracted from the response)."""
    made = entry(record)
    task = record["rg_task"]
    if task in OWN_PARSER:
        return arithmetic_score(task, answer, made["metadata"])
    return float(dataset(record).score_answer(answer=answer, entry=made))
