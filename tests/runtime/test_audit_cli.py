"""`python -m dora_jax.audit WORKDIR`: the figures of a clean ledger (exit 0), the
constraint a hand-edited one breaks (exit 1), and one line naming the file and line
of a workdir it cannot read (exit 2). The ledgers are the fake engine's (the format
every driver writes) beside the config.json of the config they were run under."""

import json
import re
import subprocess
import sys

import pytest
from _fake_run import FakeRun, lengths_from_seed
from conftest import REPO

from dora_jax.runtime.recovery import config_json
from dora_jax.scheduler import ledger
from dora_jax.scheduler.types import SchedulerConfig

STEPS = 6


@pytest.fixture
def workdir(tmp_path, small_config):
    """A dora run (K = 1, TBS 2, G 2) of STEPS steps: config.json and ledger.jsonl."""
    cfg = small_config("dora", max_staleness=1)
    run = FakeRun(SchedulerConfig.from_config(cfg),
                  lengths_from_seed(5, "uniform", cfg.rollout.max_decode_len),
                  load_ticks=2, train_ticks=6)
    run.run(STEPS)
    (tmp_path / "config.json").write_text(json.dumps(config_json(cfg)))
    _write(tmp_path, run.ledger + run.unconsumed_records())
    return tmp_path


def _write(directory, events):
    (directory / "ledger.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def _events(directory):
    return ledger.read(str(directory / "ledger.jsonl"))


def _audit(directory) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dora_jax.audit", str(directory)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def _count(out, name) -> int:
    m = re.search(rf"^{re.escape(name)} \(.*\): (\d+) violation", out.stdout, flags=re.M)
    assert m, out.stdout
    return int(m.group(1))


def test_a_clean_ledger_exits_0_with_its_figures(workdir):
    events = _events(workdir)
    out = _audit(workdir)
    assert out.returncode == 0, out.stdout + out.stderr
    admitted = len({e["group_id"] for e in events if e["event"] == "admit"})
    consumed = sum(e["event"] == "consume" for e in events)
    unconsumed = sum(e["event"] == "unconsumed" for e in events)
    assert consumed == 2 * STEPS and admitted == consumed + unconsumed > consumed
    assert f"steps: {STEPS}\n" in out.stdout
    assert (f"groups: {admitted} admitted, {consumed} consumed, 0 filtered, {unconsumed} "
            "unconsumed at exit") in out.stdout
    lags = {}
    for e in events:
        if e["event"] == "consume":
            lags[e["step"] - e["version"]] = lags.get(e["step"] - e["version"], 0) + 1
    assert set(lags) == {0, 1}, lags  # the run has stale groups to show
    assert ("staleness (step - version: groups): "
            + ", ".join(f"{k}: {v}" for k, v in sorted(lags.items()))) in out.stdout
    assert "C3 (staleness <= 1): 0 violation(s)" in out.stdout
    assert out.stdout.splitlines()[-1] == "violations: 0 (C1 0, C2 0, C3 0, batch size 0)"


def test_a_sample_of_another_version_breaks_c1(workdir):
    events = _events(workdir)
    line = next(e for e in events if e["event"] == "consume")
    n = line["samples"][1]["response_len"]
    line["samples"][1]["versions"] = [[line["version"], 1], [line["version"] + 1, n - 1]]
    _write(workdir, events)
    out = _audit(workdir)
    assert out.returncode == 1, out.stdout + out.stderr
    assert _count(out, "C1") == 1 and _count(out, "C2") == _count(out, "C3") == 0
    assert f"group {line['group_id']} sample 1 versions" in out.stdout
    assert out.stdout.splitlines()[-1].startswith("violations: 1 (C1 1,")


def test_a_dropped_group_breaks_c2(workdir):
    events = _events(workdir)
    dropped = next(e for e in events if e["event"] == "consume" and e["step"] == 2)
    _write(workdir, [e for e in events if e is not dropped])
    out = _audit(workdir)
    assert out.returncode == 1
    assert _count(out, "C2") == 1 and _count(out, "C1") == _count(out, "C3") == 0
    assert (f"group {dropped['group_id']} admitted but neither consumed, filtered nor "
            "unconsumed") in out.stdout
    assert "step 2 consumed 1 groups, not 2" in out.stdout  # its batch is short too


def test_a_group_older_than_the_bound_breaks_c3(workdir):
    events = _events(workdir)
    late = next(e for e in events if e["event"] == "consume" and e["step"] == STEPS - 1)
    v = late["step"] - 2  # staleness 2 > K = 1, one version throughout (C1 holds)
    for e in events:
        if e.get("group_id") == late["group_id"] and e["event"] in ("admit", "consume"):
            e["version"] = v
    for s in late["samples"]:
        s["versions"] = [[v, s["response_len"]]]
    _write(workdir, events)
    out = _audit(workdir)
    assert out.returncode == 1
    assert _count(out, "C3") == 1 and _count(out, "C1") == _count(out, "C2") == 0
    assert f"group {late['group_id']} (v{v}) consumed at step {late['step']}" in out.stdout


def test_missing_files_exit_2_naming_them(workdir, tmp_path_factory):
    (workdir / "ledger.jsonl").unlink()
    out = _audit(workdir)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == f"error: {workdir / 'ledger.jsonl'}: no such file"
    empty = tmp_path_factory.mktemp("empty")
    out = _audit(empty)
    assert out.returncode == 2
    assert out.stderr.startswith(f"error: {empty / 'config.json'}: no such file")
    out = _audit(empty / "nowhere")
    assert (out.returncode, out.stderr.strip()) == (2, f"error: {empty / 'nowhere'}: "
                                                       "no such directory")


def test_a_bad_line_exits_2_naming_the_file_and_line(workdir):
    path = workdir / "ledger.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:4] + ["{not json\n"] + lines[4:]))
    out = _audit(workdir)
    assert out.returncode == 2 and out.stdout == ""
    assert re.fullmatch(rf"error: {re.escape(str(path))}:5: not JSON \(.*\)", out.stderr.strip())
    # JSON, but a consume line without the samples the audit reads.
    consume = json.loads(next(x for x in lines if '"consume"' in x))
    del consume["samples"]
    path.write_text("".join(lines[:2] + [json.dumps(consume) + "\n"] + lines[2:]))
    out = _audit(workdir)
    assert out.returncode == 2
    assert out.stderr.strip() == (f"error: {path}:3: consume without a list of 'samples'")


def test_a_config_without_the_batch_size_exits_2(workdir):
    config = json.loads((workdir / "config.json").read_text())
    del config["coordinator"]["train_batch_size"]
    (workdir / "config.json").write_text(json.dumps(config))
    out = _audit(workdir)
    assert out.returncode == 2
    assert out.stderr.strip() == (f"error: {workdir / 'config.json'}: "
                                  "coordinator.train_batch_size missing or not an integer (None)")
