"""bench/sandbox.py: the escape corpus against the sandbox, and checks that can fail.

The whole-corpus test is the bench itself (about a minute on two shared cores); a
case that escapes fails it by name. The control test fires every case's tripwire
from this process, so a listener that never trips or a check that ignores its
observation is caught rather than read as containment.
"""

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from dora_jax.bench import sandbox as bench
from dora_jax.bench import sandbox_corpus as corpus
from dora_jax.bench import sandbox_host
from dora_jax.bench import sandbox_verdicts as verdicts
from dora_jax.envs import sandbox

REPO = sandbox_host.REPO
LAST = re.compile(r"^attempts: (\d+), escaped: (\d+), refused at start: (\d+), left behind: (\d+), "
                  r"cost per call ms: median [\d.]+ \(p10 [\d.]+, p90 [\d.]+\)$")


def _available(isolation, missing=()):
    return sandbox.run_python("pass", isolation=isolation, _missing=missing).ok


def test_corpus_has_every_class_and_both_paths():
    cases = corpus.cases()
    assert {c.kind for c in cases} == set(corpus.CLASSES)
    assert len({c.name for c in cases}) == len(cases)
    assert any(c.via_env for c in cases) and any(c.expect == corpus.REFUSED for c in cases)
    assert {c.isolation for c in cases} == set(sandbox.ISOLATION_LEVELS)
    for c in cases:
        assert c.expect == (corpus.REFUSED if corpus.refuses(c.isolation, c.missing)
                            else corpus.RAN), c.name


def test_every_tripwire_and_check_can_fire():
    missed = []
    with sandbox_host.Host() as host:
        for case in corpus.cases():
            if not bench.control(case, host):
                missed.append(f"{case.name} ({case.trigger})")
    assert not missed, "controls that did not register an escape: " + ", ".join(missed)


def test_observation_checks_flag_what_they_watch():
    limits = sandbox.SandboxLimits()
    probe = sandbox.run_python("pass")
    assert probe.ok

    def obs(**result):
        r = dataclasses.replace(probe, **result)
        return verdicts.Observation(r, [], probe, limits, 0.1)

    assert verdicts.contained(obs()) is None
    assert verdicts.contained(obs(stdout="ESCAPED fork 12\n"))
    assert verdicts.contained(dataclasses.replace(obs(), elapsed=limits.timeout_s + 3))
    assert verdicts.failed(obs(ok=True))
    assert verdicts.failed(obs(ok=False, error="exit status 3")) is None
    assert verdicts.same_status(obs(protections={"forged": True}))
    assert verdicts.same_status(obs(isolation="none"))
    assert verdicts.no_error(obs(error="timeout after 5.0 s"))
    assert verdicts.refused(obs(ok=True)) and verdicts.refused(
        obs(ok=False, error="refused: the sandbox needs seccomp", isolation=None)) is None
    assert verdicts.killed_other_abi(obs(ok=False, error="exit status 1"))
    assert verdicts.killed_other_abi(
        obs(ok=False, error="killed: a system call of another ABI")) is None
    tasks = verdicts.bounded("tasks", lambda lim: lim.max_tasks)
    assert tasks(obs(stdout=f"tasks {limits.max_tasks + 1}\n"))
    assert tasks(obs(stdout=f"tasks {limits.max_tasks}\n")) is None
    assert verdicts.unaffected(dataclasses.replace(obs(), stall=2.0))
    assert verdicts.unaffected(obs(stdout="x" * (limits.max_output_bytes + 100)))
    many = verdicts.Observation(probe, [], probe, limits, 0.1,
                              extra={"overlap": limits.max_sandboxes + 1})
    assert verdicts.at_most_max_sandboxes(many)
    spans = [dataclasses.replace(probe, stdout=f"span {i} {i + 10}\n") for i in range(3)]
    assert bench._spans(spans) == 3


def test_no_case_escapes_or_leaves_anything():
    if not _available("namespaces") and not _available("filters"):
        pytest.skip("the sandbox cannot run on this host")
    rows, left = bench.run_corpus()
    failures = []
    for r in rows:
        if r["escaped"]:
            failures.append(f"{r['name']}: escaped ({r['escaped']})")
        if r["left"]:
            failures.append(f"{r['name']}: left behind {r['left']}")
        if r["expect"] == corpus.REFUSED and r["outcome"] != corpus.REFUSED:
            failures.append(f"{r['name']}: ran where it must be refused")
    assert not failures, "\n".join(failures)
    assert not left, f"left on the host after the corpus: {left}"
    assert len(rows) == len(corpus.cases())


def test_cli_prints_the_summary_line():
    proc = subprocess.run(
        [sys.executable, "-m", "dora_jax.bench.sandbox", "--cases=forge_header@", "--calls=3"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = LAST.match(lines[-1])
    assert match, lines[-1]
    assert int(match.group(1)) >= 2 and match.group(2) == "0" and match.group(4) == "0"
