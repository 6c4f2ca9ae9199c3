"""Audits a run's ledger against C1-C3 under the config it recorded.

    python -m dora_jax.audit /tmp/dora_tiny

Reads `<workdir>/config.json` (the mode, batch and group sizes, staleness bound and
max_decode_len) and `<workdir>/ledger.jsonl`, across any number of resumes
(scheduler/ledger.py), and prints the steps, the groups admitted, consumed,
filtered and unconsumed at exit, the staleness histogram and each constraint's
violations, ending with `violations: N (C1 a, C2 b, C3 c, batch size d)`. Exit
status: 0 clean, 1 any violation, 2 a workdir, config.json or ledger line that
cannot be read (one line naming the file, and the line).
"""

from __future__ import annotations

import os
import sys

from dora_jax.base import untrusted_files
from dora_jax.config.modes import CAPABILITIES
from dora_jax.scheduler import ledger

_USAGE = "usage: python -m dora_jax.audit WORKDIR"


def _field(config: dict, path: str, dotted: str, *, integer: bool = True,
           optional: bool = False):
    """config.json's `section.name`; one line naming it if missing or mistyped."""
    section, name = dotted.split(".")
    value = config.get(section, {}).get(name) if isinstance(config.get(section), dict) else None
    if value is None and optional:
        return None
    if integer and (not isinstance(value, int) or isinstance(value, bool)):
        raise ledger.LedgerError(f"{path}: {dotted} missing or not an integer ({value!r})")
    return value


def audit_workdir(workdir: str) -> ledger.AuditReport:
    """The audit of `workdir`'s ledger under its config.json; LedgerError (one line
    naming the file, and the line) if either is missing, unreadable or malformed."""
    if not os.path.isdir(workdir):
        raise ledger.LedgerError(f"{workdir}: no such directory")
    path = os.path.join(workdir, "config.json")
    try:
        config = untrusted_files.read_json(path, error=ledger.LedgerError)
    except FileNotFoundError:
        raise ledger.LedgerError(f"{path}: no such file (not a run's workdir?)") from None
    mode = _field(config, path, "coordinator.mode", integer=False, optional=True)
    if mode not in CAPABILITIES:
        raise ledger.LedgerError(f"{path}: coordinator.mode {mode!r} is not one of "
                                 f"{tuple(CAPABILITIES)}")
    caps = CAPABILITIES[mode]
    tbs = _field(config, path, "coordinator.train_batch_size")
    group_size = _field(config, path, "coordinator.group_size")
    k = _field(config, path, "coordinator.max_staleness", optional=True)
    max_decode_len = _field(config, path, "rollout.max_decode_len", optional=True)
    path = os.path.join(workdir, "ledger.jsonl")
    try:
        numbered = ledger.read_numbered(path)
    except FileNotFoundError:
        raise ledger.LedgerError(f"{path}: no such file") from None
    for number, event in numbered:
        problem = ledger.check_fields(event)
        if problem:
            raise ledger.LedgerError(f"{path}:{number}: {problem}")
    return ledger.audit([e for _, e in numbered], train_batch_size=tbs,
                        group_size=group_size, max_staleness=caps.staleness_bound(k),
                        max_decode_len=max_decode_len, check_c1=caps.keeps_c1)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print(_USAGE, file=sys.stderr)
        return 2
    try:
        report = audit_workdir(argv[0])
    except ledger.LedgerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.text())
    return 0 if report.ok else 1


if __name__ == "__main__":
    from absl import app

    app.run(lambda argv: main(argv[1:]))
