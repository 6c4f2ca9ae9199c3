"""Per-token policy versions, run-length encoded: [[version, n_tokens], ...].

A trajectory's tokens may come from several versions (partial rollout reloads
under a running request); every part of the system that records or reads them —
a decode slice, a trajectory, the ledger, the train batch, the simulator and the
fake driver — uses this one encoding and these functions. No dependencies.
"""

from __future__ import annotations

from collections.abc import Iterable


def extend(runs: list, version: int, n: int) -> list:
    """Appends n tokens of `version` to `runs` in place (and returns it)."""
    if n <= 0:
        return runs
    if runs and runs[-1][0] == version:
        runs[-1][1] += n
    else:
        runs.append([version, n])
    return runs


def encode(counts: Iterable) -> list:
    """[(version, n_tokens), ...] in token order -> runs (adjacent versions merged,
    empty counts dropped)."""
    runs: list = []
    for version, n in counts:
        extend(runs, version, n)
    return runs


def expand(runs) -> list:
    """Runs -> one version per token."""
    return [v for v, n in runs for _ in range(n)]


def num_tokens(runs) -> int:
    """Tokens the runs cover."""
    return sum(n for _, n in runs)
