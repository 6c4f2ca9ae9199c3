"""The notebooks under colab/ run as written, with fewer steps (their environment
variables shrink them)."""

import json

import pytest

from conftest import REPO


def _code(name: str) -> str:
    nb = json.load(open(REPO / "colab" / name))
    assert nb["nbformat"] == 4
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert not any(c["outputs"] for c in cells), "outputs are not stored in the notebook"
    return "\n".join("".join(c["source"]) for c in cells)


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
