"""The notebooks under colab/ run as written, with fewer steps (their environment
variables shrink them); they open in Colab, install the package where it is missing,
load their configs by name, and carry the outputs of a full run (saved by
colab/save_outputs.py)."""

import configparser
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO, env_without_device_count

NOTEBOOKS = ("quickstart.ipynb", "modes.ipynb", "multiturn.ipynb")


def _cells(name: str) -> list[dict]:
    nb = json.load(open(REPO / "colab" / name))
    assert nb["nbformat"] == 4
    return nb["cells"]


def _code(name: str) -> str:
    cells = [c for c in _cells(name) if c["cell_type"] == "code"]
    return "\n".join("".join(c["source"]) for c in cells)


def _outputs(name: str, cell_says: str) -> tuple[str, list[str]]:
    """(the saved text, the saved output kinds) of the code cell whose source has
    `cell_says`."""
    cell, = [c for c in _cells(name) if c["cell_type"] == "code"
             and cell_says in "".join(c["source"])]
    text = "".join("".join(o.get("text", "")) for o in cell["outputs"])
    kinds = [k for o in cell["outputs"] for k in o.get("data", {})]
    return text, kinds


def _repository_url() -> str:
    """The repository's URL, as the package metadata gives it (setup.cfg)."""
    meta = configparser.ConfigParser()
    meta.read(REPO / "setup.cfg")
    url = meta["metadata"]["url"]
    assert f"Source = {url}" in meta["metadata"]["project_urls"]
    return url


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_opens_in_colab_and_installs_from_the_repository(name):
    cells = _cells(name)
    intro, code = "".join(cells[0]["source"]), _code(name)
    repository = re.search(r"REPOSITORY = '(https://github.com/([^/']+/[^/']+))'", code)
    assert repository, "the install cell names the repository"
    assert repository.group(1) == _repository_url()
    assert "OWNER" not in (REPO / "colab" / name).read_text(), "a placeholder is left"
    badge = (f"https://colab.research.google.com/github/{repository.group(2)}/blob/main/"
             f"colab/{name}")
    assert "colab-badge.svg" in intro and badge in intro
    assert "pip', 'install'" in code and "git+{REPOSITORY}" in code
    assert "configs/" not in re.sub(r"#.*", "", code), "configs load by name, not by path"


def test_readme_names_the_repository():
    url = _repository_url()
    assert f"git clone {url}" in (REPO / "README.md").read_text()
    assert f"pip install git+{url}" in (REPO / "docs" / "notebooks.md").read_text()


def test_saved_outputs_show_the_curves():
    """A reader sees the results without running anything: the quickstart's audit,
    reward curve (first and last steps) and greedy accuracies; the modes' table and
    timelines."""
    text, kinds = _outputs("quickstart.ipynb", "reward_curve.png")
    assert "image/png" in kinds
    first, last = map(float, re.search(r"first \d+ steps: ([\d.]+), last \d+ steps: ([\d.]+)",
                                       text).groups())
    assert last > first, text
    text, _ = _outputs("quickstart.ipynb", "experiment.run(")
    assert "audit clean: True" in text
    text, _ = _outputs("quickstart.ipynb", "greedy accuracy")
    assert "warm start: greedy accuracy" in text and "after RL: greedy accuracy" in text
    text, _ = _outputs("modes.ipynb", "def staleness(")
    assert re.search(r"^dora +\d+", text, flags=re.M), text
    _, kinds = _outputs("modes.ipynb", "timelines.png")
    assert "image/png" in kinds
    text, kinds = _outputs("multiturn.ipynb", "episode_curve.png")
    assert "image/png" in kinds
    (r0, u0, c0), (r1, u1, c1) = [tuple(map(float, m)) for m in re.findall(
        r"reward ([\d.]+), tool use ([\d.]+), correct tool use ([\d.]+)", text)]
    assert r1 > r0 and c1 > c0, text
    text, _ = _outputs("multiturn.ipynb", "one episode in the ledger")
    assert "audit clean: True" in text and '"turns": [["model", 0, ' in text
    text, _ = _outputs("multiturn.ipynb", "sandbox.run_python")
    for refused in ("write outside scratch", "network", "fork bomb", "memory", "endless loop"):
        assert re.search(rf"^{refused} +ok=False ", text, flags=re.M), text
    text, _ = _outputs("multiturn.ipynb", "without a tool")
    tool, bare = map(float, re.search(r"with the calculator ([\d.]+), without a tool "
                                      r"([\d.]+)", text).groups())
    assert tool > bare, text


def _wheel(tmp_path) -> str:
    """A wheel of the package, built from a copy of the sources (a build in the clone
    would leave its build/ behind, whose stale files a later wheel could pick up)."""
    import shutil

    source = tmp_path / "source"
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", "build", "*.egg-info", "__pycache__", "tests", "colab"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(source),
                          "-w", str(tmp_path / "dist")], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    wheel, = (tmp_path / "dist").glob("dora_jax-*.whl")
    return str(wheel)


def _fresh_venv(tmp_path) -> str:
    """A new virtual environment outside the clone, without dora_jax, whose other
    dependencies (and pip) are this environment's: they are seen through a path file,
    which adds the directory but not its own path files, so this environment's
    dora_jax (a clone's editable install) stays invisible."""
    import site
    import sysconfig

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True,
                             check=True).stdout.strip()
    ours = [p for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]]
            if os.path.isdir(p)]
    with open(os.path.join(purelib, "dependencies.pth"), "w") as f:
        f.write("\n".join(dict.fromkeys(ours)) + "\n")
    return python


def _outside_env(tmp_path, **extra) -> dict:
    env = env_without_device_count("PYTHONPATH")
    return {**env, "MPLBACKEND": "Agg", **extra}


# The notebook's check, run after its cells in the same process: what the notebook made.
_QUICKSTART_CHECK = """
import json as _json
print('quickstart check: ' + _json.dumps(dict(
    ok=bool(report.ok), steps=summary['steps'], rewards=len(rewards),
    hf=sorted(os.listdir(hf_dir)))))
"""


@pytest.mark.slow
def test_colab_quickstart_runs_from_a_wheel_in_a_fresh_environment(tmp_path):
    """The notebook as a Colab user runs it: its install cell installs the wheel (as
    DORA_JAX_PIP says) into a fresh environment outside the clone, then every cell
    runs, a few steps each: warm start, an RL run whose ledger audits clean, the
    reward curve, the export loaded back. The installed wheel then ships the configs:
    they load by name from a directory that is not the clone, and the flagship
    command answers as documented. (One fresh environment and one wheel for both; the
    in-process run of the notebook that tests/runtime/test_e2e.py had is this one.)"""
    python = _fresh_venv(tmp_path)
    env = _outside_env(tmp_path)
    out = subprocess.run([python, "-c", "import dora_jax"], capture_output=True, env=env,
                         cwd=tmp_path)
    assert out.returncode != 0, "dora_jax must not be importable before the install"
    script = tmp_path / "quickstart.py"
    script.write_text(_code("quickstart.ipynb") + "\n" + _QUICKSTART_CHECK)
    run_env = _outside_env(tmp_path, DORA_JAX_PIP=f"--no-deps --ignore-installed "
                                                  f"{_wheel(tmp_path)}",
                           QUICKSTART_DIR=str(tmp_path / "run"), QUICKSTART_SFT_STEPS="10",
                           QUICKSTART_RL_STEPS="3")
    # With -c, as in a notebook kernel, __main__ has no file: the reward pool's worker
    # processes would run a script's file again.
    run = f"exec(compile(open({str(script)!r}).read(), 'quickstart.ipynb', 'exec'))"
    out = subprocess.run([python, "-c", run], capture_output=True, text=True, env=run_env,
                         cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "audit clean: True | steps: 3" in out.stdout, out.stdout
    check = json.loads(out.stdout.split("quickstart check: ")[-1].splitlines()[0])
    assert check["ok"] and check["steps"] == 3 and check["rewards"] == 3, check
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(check["hf"]), check
    assert (tmp_path / "run" / "reward_curve.png").exists()
    installed = list((tmp_path / "venv").glob("lib/python*/site-packages/dora_jax/configs"))
    assert installed, "the install cell installed the wheel into the fresh environment"

    code = ("import dora_jax, os; from dora_jax import config, configs\n"
            "from dora_jax.model import hf_checks\n"
            "print(os.path.dirname(dora_jax.__file__)); print(','.join(configs.names()))\n"
            "print(hf_checks.validated(config.load('quickstart')).data.source)")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    where, names, source = out.stdout.split()
    assert where.startswith(str(tmp_path / "venv")), where
    assert names == "longtail,moe,multiturn,quickstart,qwen3_gsm8k,tiny"
    assert source == "reasoning_gym"
    out = subprocess.run([python, "-m", "dora_jax.main", "--config=moe",
                          f"--workdir={tmp_path / 'moe'}"], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=300)
    assert out.returncode != 0 and out.stderr.strip() == (
        "error: config.mesh: moe needs 256 devices (trainer 128 + 8 decode slices x 16), "
        "but this host has 1 (cpu): run moe:tiny here"), out.stderr


@pytest.mark.slow
def test_colab_modes_runs(tmp_path, monkeypatch):
    """Warm start, then sync and dora from it: both ledgers audit clean, each mode
    trains its steps, and the stacked timelines are drawn."""
    monkeypatch.setenv("MODES_DIR", str(tmp_path))
    monkeypatch.setenv("MODES_SFT_STEPS", "20")
    monkeypatch.setenv("MODES_RL_STEPS", "3")
    monkeypatch.setenv("MODES_LIST", "sync,dora")
    monkeypatch.chdir(REPO)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    namespace = {}
    try:
        exec(compile(_code("modes.ipynb"), "modes.ipynb", "exec"), namespace)
    finally:
        plt.close("all")
    assert set(namespace["summaries"]) == set(namespace["reports"]) == {"sync", "dora"}
    for mode, report in namespace["reports"].items():
        assert report.ok, f"{mode}: {report.summary()}"
        assert report.steps == 3 and namespace["summaries"][mode]["steps"] == 3, mode
    assert namespace["baseline"] == "sync"
    assert (tmp_path / "timelines.png").exists()


@pytest.mark.slow
def test_colab_multiturn_runs(tmp_path, monkeypatch):
    """Warm start on whole episodes, then RL in dora: the ledger audits clean and
    the episode curve is drawn (the baseline without the tool left out)."""
    monkeypatch.setenv("MULTITURN_DIR", str(tmp_path))
    monkeypatch.setenv("MULTITURN_SFT_STEPS", "5")
    monkeypatch.setenv("MULTITURN_RL_STEPS", "3")
    monkeypatch.setenv("MULTITURN_BASELINE", "0")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    namespace = {}
    try:
        exec(compile(_code("multiturn.ipynb"), "multiturn.ipynb", "exec"), namespace)
    finally:
        plt.close("all")
    assert namespace["report"].ok, namespace["report"].summary()
    assert namespace["summary"]["steps"] == 3 and len(namespace["steps"]) == 3
    assert (tmp_path / "episode_curve.png").exists()
