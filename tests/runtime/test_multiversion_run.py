"""Runs whose slices hold several LoRA versions at once (rollout.versions_per_slice V,
dora): end to end on real slices, audited, across a slice failure and a resume."""

import json

import pytest

from dora_jax import config as config_lib
from dora_jax.config import ConfigError
from dora_jax.runtime import experiment

pytestmark = pytest.mark.slow


def _config(small_config, **coordinator):
    c = small_config("dora", validate=False, **coordinator)
    c.model.lora.rank = 4
    c.rollout.versions_per_slice = c.coordinator.max_staleness + 1
    return c


def _lines(path):
    return [json.loads(line) for line in open(path)]


def test_a_run_holds_several_versions_per_slice_and_audits_clean(small_config, tmp_path):
    """V = K + 1: every slice adds each version as soon as it is published, beside
    the one whose samples it may still decode, so no sample waits for a slice to
    drain and none migrates; every trajectory is one version's (C1, audited)."""
    from conftest import audit_workdir

    c = _config(small_config, num_steps=5)
    cfg = config_lib.validate(c, num_devices=8)
    summary = experiment.run(cfg, str(tmp_path))
    events, report = audit_workdir(cfg, str(tmp_path))
    assert report.ok, report
    assert summary["steps"] == 5 and summary["migrations"] == 0
    assert summary["max_resident_versions"] == 2
    consumed = [e for e in events if e["event"] == "consume"]
    assert all(len(s["versions"]) == 1 for e in consumed for s in e["samples"])
    assert {s["versions"][0][0] for e in consumed for s in e["samples"]} != {0}
    metrics = _lines(tmp_path / "metrics.jsonl")
    assert any(len(r["resident_versions"]) == 2 for r in metrics)
    spans = json.loads((tmp_path / "timeline.json").read_text())
    for i in range(cfg.mesh.num_slices):
        loads = sorted(s["version"] for s in spans if s["row"] == f"slice {i}"
                       and s["kind"] == "load")
        assert loads == list(range(1, 5)), (i, loads)


def test_a_failed_multi_version_slice_restarts_and_nothing_is_lost(small_config, tmp_path):
    """Slice 1 raises at its first generate call, holding samples: they are
    regenerated under their groups' versions, the emptied slice is given versions
    again (added into its free places), and the ledger audits clean."""
    from conftest import audit_workdir

    c = _config(small_config, num_steps=4, fail_slice=1, fail_point="generate")
    cfg = config_lib.validate(c, num_devices=8)
    summary = experiment.run(cfg, str(tmp_path))
    _, report = audit_workdir(cfg, str(tmp_path))
    assert report.ok, report
    assert summary["slice_failures"] == 1 and report.steps == 4
    (failed,) = [e for e in _lines(tmp_path / "ledger.jsonl") if e["event"] == "slice_failed"]
    assert failed["slice"] == 1 and failed["regenerated"] > 0
    # The restarted slice is given each version published after its failure (and
    # the one it lost, unless the others finished that version's work first).
    # Whether it decodes too depends on how soon the other slices finish the work.
    spans = json.loads((tmp_path / "timeline.json").read_text())
    loads = sorted(s["version"] for s in spans if s["row"] == "slice 1"
                   and s["kind"] == "load" and s["start"] > failed["time"])
    assert {1, 2, 3} <= set(loads) <= {0, 1, 2, 3}, loads


def test_a_multi_version_run_resumes_and_evaluates(small_config, tmp_path):
    """Stopped after 2 steps and continued to 4, with held-out evaluation on a
    multi-version slice: the ledger of both parts audits clean."""
    from conftest import audit_workdir

    c = _config(small_config, num_steps=2, checkpoint_every=1)
    c.eval.update(dict(every=2, num_prompts=2, samples=2, k=2))
    cfg = config_lib.validate(c, num_devices=8)
    experiment.run(cfg, str(tmp_path))
    c.coordinator.num_steps = 4
    cfg = config_lib.validate(c, num_devices=8)
    experiment.run(cfg, str(tmp_path))
    events, report = audit_workdir(cfg, str(tmp_path))
    assert report.ok, report
    assert report.steps == 4 and any(e["event"] == "resume" for e in events)
    evals = [r for r in _lines(tmp_path / "metrics.jsonl") if "eval" in r]
    assert evals


@pytest.mark.parametrize("edit, field, words", [
    (lambda c: c.coordinator.update(mode="partial_rollout"), "rollout.versions_per_slice",
     "only in dora"),
    (lambda c: c.model.lora.update(rank=0), "rollout.versions_per_slice", "lora.rank > 0"),
])
def test_several_versions_per_slice_need_dora_and_lora(small_config, edit, field, words):
    c = _config(small_config)
    edit(c)
    with pytest.raises(ConfigError, match=field) as e:
        config_lib.validate(c, num_devices=8)
    assert words in str(e.value)
