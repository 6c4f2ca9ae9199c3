"""Smoke tests: every benchmark and tool entry point run as `python -m ...` (its own
flags, its own process, the repository as working directory) at tiny sizes. Each
must exit 0 and end with its documented final line, whose figure must parse as a
finite number in a plausible range.

The tools that read a real run (`sim.calibrate`, `sim.validate`, `export`, `audit`)
share one `bench.modes` run (sync and dora, 3 steps each, tiny config), made once per test
session even when xdist spreads these tests over workers."""

import ast
import fcntl
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import REPO, env_without_device_count

TINY = ["--config=configs/tiny.py:spread", "--config.model.num_layers=1"]
MODES_STEPS = 3
MODES_SPECS = ("colocated_sync", "sync", "dora_k2")
NUMBER = r"(-?\d+(?:\.\d+)?(?:e[+-]?\d+)?)"


def run_module(module: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m module args` from the repository root, with this process's
    environment (XLA_FLAGS, the compilation cache, PYTHONPATH)."""
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def final_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert lines, out.stderr[-3000:]
    print(lines[-1])
    return lines[-1]


def parse(line: str, pattern: str, low: float, high: float) -> re.Match:
    """The final line matched in full by `pattern`; its first group a finite number
    in [low, high]."""
    m = re.fullmatch(pattern, line)
    assert m, f"final line {line!r} does not match {pattern!r}"
    x = float(m.group(1))
    assert math.isfinite(x) and low <= x <= high, f"{x} outside [{low}, {high}]: {line!r}"
    return m


@pytest.fixture(scope="module")
def modes_run(tmp_path_factory):
    """(bench.modes' output directory, its completed process): MODES_SPECS, one
    repetition of MODES_STEPS steps each from the random init. Made once per session:
    the xdist workers share the base temp directory's parent and take turns on a lock."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    workdir, record = root / "entry_points_modes", root / "entry_points_modes.json"
    with open(root / "entry_points_modes.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not record.exists():
            out = run_module("dora_jax.bench.modes", *TINY, f"--workdir={workdir}",
                             f"--steps={MODES_STEPS}", "--reps=1",
                             f"--modes={','.join(MODES_SPECS)}", "--sft_steps=0")
            record.write_text(json.dumps([out.returncode, out.stdout, out.stderr]))
        returncode, stdout, stderr = json.loads(record.read_text())
    return workdir, subprocess.CompletedProcess([], returncode, stdout, stderr)


# bench.engine and bench.trainer: tests/bench/test_bench_accelerator.py runs them (its CPU form).


@pytest.mark.slow
def test_bench_trainer_long_tail():
    out = run_module("dora_jax.bench.trainer", "--config=configs/longtail.py",
                     "--lengths=long_tail", "--steps=1", "--rounds=1", "--groups=4",
                     "--group_size=4", "--config.model.num_layers=1")
    parse(final_line(out), rf"packed/padded peak memory: {NUMBER}", 0.001, 10)
    parse(out.stdout.strip().splitlines()[-2], rf"packed/padded real tokens/s: {NUMBER}",
          0.01, 100)


@pytest.mark.slow
def test_bench_modes(modes_run):
    """The table's runs, each audited clean with its steps and timeline, the colocated
    sync all on-policy (TBS 4 x 3 steps at staleness 0), and the headline ratios.
    (Also what tests/bench/test_bench.py's end-to-end run of `modes.bench_modes` checked.)"""
    workdir, out = modes_run
    parse(final_line(out), rf"dora/best-other tokens/s ratio: {NUMBER}", 0.01, 100)
    assert "dora/sync tokens/s ratio: " in out.stdout
    for spec in MODES_SPECS:
        assert re.search(rf"^{spec} rep 0: \d+ tokens/s, audit clean$", out.stdout,
                         flags=re.M), out.stdout
        summary = json.loads((workdir / spec / "0" / "summary.json").read_text())
        assert summary["audit_ok"] and summary["steps"] == MODES_STEPS, spec
        assert (workdir / spec / "0" / "timeline.png").exists(), spec
    assert json.loads((workdir / "dora_k2" / "0" / "summary.json").read_text())["mode"] == "dora"
    rows = json.loads((workdir / "bench.json").read_text())["rows"]
    assert set(rows) == set(MODES_SPECS)
    assert rows["colocated_sync"]["staleness"] == {"0": 4 * MODES_STEPS}


@pytest.mark.slow
def test_bench_processes():
    """Publication in one process and across two (tiny shape), the cross-process fit,
    the gather of a trainer over two processes, and the coordinator driving 8 fake
    slices over the wire."""
    out = run_module("dora_jax.bench.processes", "--shapes=tiny", "--reps=2", "--slices=8",
                     "--seconds=2")
    lines = out.stdout.splitlines()
    parse(final_line(out), rf"coordinator decisions/s at 8 slices: {NUMBER}", 1, 1e6)
    for what in ("full", "adapters"):
        assert any(x.startswith(f"publish tiny {what}: ") for x in lines), out.stdout
    assert any(x.startswith("simulator transfer cost (cross-process, this host): "
                            "transfer_latency=") for x in lines), out.stdout
    for what in ("full", "adapters"):  # a trainer over two processes gathers a version
        gathered = next((x for x in lines if x.startswith(f"trainer gather tiny {what}: ")),
                        out.stdout)
        parse(gathered, rf"trainer gather tiny {what}: {NUMBER} MB, in one process {NUMBER} "
              rf"ms, gathered over 2 trainer processes {NUMBER} ms \({NUMBER} GB/s\)",
              0.01, 1)
    ratio = next(x for x in lines if x.startswith("cross-process/in-process"))
    parse(ratio, rf"cross-process/in-process publish seconds \(tiny, full\): {NUMBER}",
          0.01, 1e4)


@pytest.mark.slow
def test_bench_scale():
    out = run_module("dora_jax.bench.scale", "--parts=prefill", "--reps=1")
    m = parse(final_line(out), rf"prefills per group: {NUMBER}", 1, 4)
    assert float(m.group(1)) == 1  # a group's prompt is prefilled once


# bench.crash: tests/runtime/test_crash.py::test_five_kills_lose_and_duplicate_nothing runs it
# (`python -m dora_jax.bench.crash`, tiny config, 1 layer) and checks its final line.


def test_help_texts_escape_their_percent_signs():
    """absl's --help formats a command's docstring with `%` (`%%` prints `%`): a lone
    `%` in any command's docstring would print the program's path in its place."""
    paths = [p for p in sorted((REPO / "dora_jax").rglob("*.py")) + sorted(
        (REPO / "launchers").glob("*.py")) if "app.run(" in p.read_text()]
    assert len(paths) > 10, paths
    for path in paths:
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        assert "%" not in doc.replace("%%", ""), f"{path.relative_to(REPO)}: write % as %%"


def test_sim_help_prints_percentages():
    out = run_module("dora_jax.sim", "--help")  # absl's --help exits 1 here
    doc = (out.stdout + out.stderr).split("\nflags:\n")[0]
    assert doc.startswith("Simulates every mode") and "--preset" in out.stdout, doc
    assert "states under 0.5% are left out" in doc, doc
    assert str(REPO) not in doc and "__main__.py" not in doc


def test_main_help_lists_every_config():
    out = run_module("dora_jax.main", "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    listed = out.stdout.split("\nflags:\n")[0].split("\nConfigs (")[1].splitlines()[1:]
    names = {line.split()[0] for line in listed if line.strip() and
             not line.strip().startswith("variants:")}
    shipped = {p.stem for p in (REPO / "configs").glob("[!_]*.py")}
    assert len(shipped) > 5 and names == shipped, (names, shipped)
    assert any(line.split()[0] == "multiturn" and "tool" in line for line in listed)


def test_sim(tmp_path):
    out = run_module("dora_jax.sim", "--preset=paper64", "--steps=2", "--modes=sync,dora",
                     "--jobs=1", f"--workdir={tmp_path}")
    parse(final_line(out), rf"dora rollout-only share: {NUMBER}", 0, 1)
    speedup = next(line for line in out.stdout.splitlines() if line.startswith("dora/sync "))
    parse(speedup, rf"dora/sync step-time speedup: {NUMBER}  \(against \w+\)", 0.1, 10)


@pytest.mark.slow
def test_sim_calibrate(modes_run):
    workdir, _ = modes_run
    out = run_module("dora_jax.sim.calibrate", f"--workdir={workdir / 'sync' / '0'}",
                     "--config=configs/tiny.py:spread", "--cores=2")
    # A few-step tiny run can leave the per-slot term at 0 (the call overhead fits it
    # all): the line must parse; the fit itself is tested in tests/sim/test_sim.py.
    parse(final_line(out), rf"decode step at 8 busy slots: {NUMBER} ms", 0.0, 1e4)


@pytest.mark.slow
def test_sim_validate(modes_run):
    workdir, _ = modes_run
    out = run_module("dora_jax.sim.validate", f"--workdir={workdir}", "--calibrate_on=sync",
                     "--config=configs/tiny.py:spread", "--cores=2")
    parse(final_line(out), rf"max relative error: {NUMBER}", 0, 100)


@pytest.mark.slow
def test_audit(modes_run):
    workdir, _ = modes_run
    out = run_module("dora_jax.audit", str(workdir / "dora_k2" / "0"))
    parse(final_line(out), rf"violations: {NUMBER} \(C1 0, C2 0, C3 0, batch size 0\)", 0, 0)
    assert f"steps: {MODES_STEPS}\n" in out.stdout


@pytest.mark.slow
def test_export(modes_run, tmp_path):
    workdir, _ = modes_run
    out = run_module("dora_jax.export", *TINY, f"--workdir={workdir / 'sync' / '0'}",
                     f"--out={tmp_path / 'hf'}")
    m = parse(final_line(out), rf"wrote step {NUMBER} of \S+ to \S+/ \((.+)\)",
              MODES_STEPS, MODES_STEPS)
    written = m.group(2).split(", ")
    assert all(name.endswith(".safetensors") for name in written), written
    assert all((tmp_path / "hf" / name).exists() for name in written + ["config.json"])


@pytest.mark.slow
def test_sft(tmp_path):
    out = run_module("dora_jax.sft", *TINY, f"--workdir={tmp_path}", "--steps=3",
                     "--batch_size=4", "--config.data.source=countdown",
                     "--config.data.reward=countdown", "--config.data.max_count=12")
    m = parse(final_line(out), rf"sft: loss {NUMBER} -> {NUMBER}; start RL with "
              r"--config.init_checkpoint=(\S+)", 1e-3, 100)
    assert 0 < float(m.group(2)) < 100 and os.path.isdir(os.path.join(m.group(3), "3"))
    # Progress while it compiles, then while it trains: a line per step at 3 steps
    # (every tenth of the run).
    assert re.search(r"^compiling: train step .*\ncompiled in \d+ s: train step", out.stdout,
                     flags=re.M), out.stdout
    progress = re.findall(rf"^sft step (\d)/3: loss {NUMBER}, {NUMBER} steps/s$", out.stdout,
                          flags=re.M)
    assert [n for n, _, _ in progress] == ["1", "2", "3"], out.stdout


@pytest.mark.slow
def test_bench_peer(tmp_path):
    out = run_module("dora_jax.bench.peer", "--workload=tiny", "--steps=6", "--warmup=2",
                     "--rounds=1", "--nostop", f"--workdir={tmp_path}")
    parse(final_line(out),
          rf"response tokens/s: {NUMBER} \(median of 1 rounds, dora, tiny, tiny\)", 1, 1e7)
    lines = out.stdout.splitlines()
    (row,) = [x for x in lines if x.startswith("dora median")]
    # No stop token: every response runs to the limit of 16 (all cut there).
    assert float(row.split()[-2]) == 16 and float(row.split()[-1]) == 1.0
    cpu = lines[lines.index(row) + 1].split()  # the steady state's CPU by part
    assert cpu[:3] == ["cpu", "ms/step", "xla"] and cpu[-2] == "total"
    assert float(cpu[-1]) > 0


def test_bench_peer_tunix_without_tunix_says_what_to_install():
    """The peer's side runs where tunix is installed (not in CI): without it, one line
    naming the package to install, before any compute."""
    out = run_module("dora_jax.bench.peer_tunix", "--steps=3")
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        "error: tunix: not installed (pip install google-tunix==0.1.7)"), out.stderr


# --workdir checked before any compute (cli.workdir_to_write / workdir_to_read).
WRITERS = [("dora_jax.main", []), ("dora_jax.sft", [])]
READERS = [("dora_jax.export", ["--out=/tmp/never_written"])]


def workdir_error(entry: str, extra: list, workdir) -> str:
    """The one line `entry` ends with for `workdir`, which it must give before any
    compute: nothing on stdout, where faking the CPU devices would put its note."""
    env = env_without_device_count()
    out = subprocess.run([sys.executable, "-m", entry, *TINY, *extra, f"--workdir={workdir}"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode != 0 and len(lines) == 1, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout == "", out.stdout
    assert lines[0].startswith("error: --workdir: "), lines[0]
    return lines[0]


@pytest.mark.parametrize("entry, extra", WRITERS + READERS)
def test_a_workdir_that_is_a_regular_file_is_one_line(entry, extra, tmp_path):
    path = tmp_path / "run"
    path.write_text("not a directory")
    line = workdir_error(entry, extra, path)
    assert line.endswith(f"{path} exists and is not a directory" if (entry, extra) in WRITERS
                         else f"{path} is not a directory"), line
    assert path.read_text() == "not a directory"


def test_a_workdir_named_like_the_config_leaves_its_hint_alone(tmp_path):
    """The workdir is made before the device check: a directory `moe` made in the
    working directory must not become the `moe` the check's hint reads."""
    env = env_without_device_count()
    out = subprocess.run([sys.executable, "-m", "dora_jax.main", "--config=moe",
                          "--workdir=moe"], env=env, capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode != 0 and (tmp_path / "moe").is_dir(), out.stderr[-3000:]
    assert out.stderr.strip().endswith("run moe:tiny here"), out.stderr[-3000:]


@pytest.mark.parametrize("entry, extra", WRITERS)
def test_a_workdir_whose_creation_fails_is_one_line(entry, extra, tmp_path):
    """A regular file among its parents: the directory cannot be made, root or not."""
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "run"
    line = workdir_error(entry, extra, path)
    assert line == f"error: --workdir: cannot create {path}: Not a directory"


def _no_write_permission(tmp_path):
    """(a directory this process may not write in, a path it may not create): where
    permission bits apply, a read-only directory; as root they do not, so places the
    kernel refuses root too: /proc/sys (a read-only mount: access(W_OK) says no) and
    a new directory in /sys (mkdir there fails with EPERM)."""
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        return locked, locked / "run"
    if os.access("/proc/sys", os.W_OK) or not os.path.isdir("/sys"):
        pytest.skip("running as root with no place the kernel refuses root a write")
    return pathlib.Path("/proc/sys"), pathlib.Path(f"/sys/dora_jax_{os.getpid()}")


@pytest.mark.parametrize("entry, extra", WRITERS)
def test_a_workdir_without_write_permission_is_one_line(entry, extra, tmp_path):
    existing, to_create = _no_write_permission(tmp_path)
    assert workdir_error(entry, extra, existing) == (
        f"error: --workdir: {existing} is not writable by this user")
    line = workdir_error(entry, extra, to_create)
    assert line.startswith(f"error: --workdir: cannot create {to_create}: "), line
    assert ("Permission denied" in line or "Operation not permitted" in line), line
    assert not to_create.exists()
