"""JetStream's own server loop serving our Engine, at JetStream's final commit.

    python -m dora_jax.bench.jetstream [--src=DIR] [--repo=URL]

The check CI cannot run: JetStream at that commit is on no package registry (PyPI's
google-jetstream 0.2.2 is an older orchestrator), and its server imports seqio, hence
TensorFlow. Run it from a clone of dora_jax with `pip install -e ".[jetstream]"`.

Clones `--repo` (JetStream's GitHub) into `--src` unless a checkout is there, checks out
the final commit, checks that the server's dependencies import, then runs this clone's
tests of JetStream's orchestrator (tests/rollout/test_jetstream_server.py: token and text
requests, more than slots, greedy and sampled, both modes, paged KV) and of
`dora_jax.serve` (a trained quickstart checkpoint answered through the orchestrator and
through JetStream's gRPC client), with JETSTREAM_SRC set. A skipped test fails the check.
Ends with `jetstream <commit>: N passed, F failed, S skipped`.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

from absl import app, flags

from dora_jax import serve

FINAL_COMMIT = "acd4f5ad50ed2fb38e0e5bd7defd81e34a62706c"  # JetStream's archival notice
REPO_URL = "https://github.com/AI-Hypercomputer/JetStream"
TESTS = ("tests/rollout/test_jetstream_server.py",
         "tests/test_serve.py::test_serve_answers_from_a_trained_quickstart_checkpoint",
         "tests/test_serve.py::test_the_buckets_are_jetstream_s")

_SRC = flags.DEFINE_string("src", os.path.expanduser("~/.cache/dora_jax/jetstream"),
                           "JetStream's checkout: cloned here unless present")
_REPO = flags.DEFINE_string("repo", REPO_URL, "where to clone JetStream from")


class CheckError(Exception):
    """What stops the check before any test runs, said in one line."""


def _git(*args: str, cwd: str | None = None) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["failed"])[-1]
        raise CheckError(f"git {' '.join(args)}: {last}")
    return out.stdout.strip()


def checkout(src: str, repo: str, commit: str = FINAL_COMMIT) -> str:
    """`src` at `commit`, cloned from `repo` first unless `src` is a git checkout; the
    commit checked out (a checkout that cannot reach it is an error, not a fallback)."""
    if not os.path.isdir(os.path.join(src, ".git")):
        if os.path.exists(src) and os.listdir(src):
            raise CheckError(f"--src={src}: exists and is not a git checkout")
        os.makedirs(os.path.dirname(os.path.abspath(src)), exist_ok=True)
        _git("clone", "--quiet", repo, src)
    try:
        _git("cat-file", "-e", f"{commit}^{{commit}}", cwd=src)
    except CheckError:
        raise CheckError(f"--src={src}: has no commit {commit[:7]} (JetStream's final "
                         f"commit); fetch it, or remove the directory to clone anew")
    _git("-c", "advice.detachedHead=false", "checkout", "--quiet", commit, cwd=src)
    return commit


def tests_root() -> pathlib.Path:
    """The dora_jax clone whose tests run (the package's parent directory)."""
    root = pathlib.Path(__file__).resolve().parents[2]
    missing = [t for t in TESTS if not (root / t.split("::")[0]).is_file()]
    if missing:
        raise CheckError(f"{root} has no {missing[0]}: run from a clone of dora_jax "
                         f"(pip install -e '.[jetstream]')")
    return root


def counts(junit_xml: str) -> dict:
    """Tests, failures (errors included) and skips of a pytest JUnit report."""
    root = ET.parse(junit_xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {"tests": 0, "failed": 0, "skipped": 0}
    for s in suites:
        total["tests"] += int(s.get("tests", 0))
        total["failed"] += int(s.get("failures", 0)) + int(s.get("errors", 0))
        total["skipped"] += int(s.get("skipped", 0))
    total["passed"] = total["tests"] - total["failed"] - total["skipped"]
    return total


def run_tests(root: pathlib.Path, src: str) -> dict:
    env = dict(os.environ, JETSTREAM_SRC=src)
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "junit.xml")
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                        f"--junitxml={report}", *TESTS], cwd=root, env=env)
        if not os.path.exists(report):
            raise CheckError("pytest wrote no report (see its output above)")
        return counts(report)


def main(argv):
    del argv
    try:
        root = tests_root()
        missing = [m for m in serve.missing_modules() if m != "jetstream"]
        if missing:
            raise CheckError(f"JetStream's server needs {missing}: "
                             f"pip install -e '{root}[jetstream]'")
        commit = checkout(_SRC.value, _REPO.value)
        print(f"JetStream {commit[:7]} in {_SRC.value}", flush=True)
        c = run_tests(root, _SRC.value)
    except CheckError as e:
        sys.exit(f"error: {e}")
    print(f"jetstream {commit[:7]}: {c['passed']} passed, {c['failed']} failed, "
          f"{c['skipped']} skipped")
    if c["failed"] or c["skipped"] or not c["passed"]:
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
