"""The layering the package promises: the scheduling core and the config load without
JAX (the scheduler's tests, its fake driver and the simulator need no accelerator
stack); each layer imports only the layers below it (the directions below); the mode
registry matches the config's list of modes."""

import ast
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
HEAVY = ("jax", "jaxlib", "flax", "grain", "orbax", "optax")


@pytest.mark.parametrize("module", ["dora_jax.config", "dora_jax.scheduler",
                                    "dora_jax.scheduler.ledger", "dora_jax.timeline",
                                    "dora_jax.sim", "dora_jax.sim.__main__",
                                    "dora_jax.devices", "dora_jax.versions"])
def test_pure_modules_import_no_jax(module):
    code = (f"import sys, {module}\n"
            f"heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))\n"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "", f"importing {module} loaded {out}"


def test_config_imports_only_its_own_modules_from_the_package():
    code = ("import sys, dora_jax.config\n"
            "print(sorted(m for m in sys.modules if m.startswith('dora_jax.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == ("['dora_jax.config', 'dora_jax.config_data', 'dora_jax.config_model', "
                   "'dora_jax.config_report', 'dora_jax.schema']")


def test_versions_encoding_is_ground_floor_and_decode_needs_no_scheduler():
    """One run-length encoding of per-token versions (dora_jax.versions) with no
    dependency; the decode slices and the train batch use it without pulling in the
    scheduling core."""
    code = ("import sys, dora_jax.versions\n"
            "a = sorted(m for m in sys.modules if m.startswith('dora_jax.'))\n"
            "import dora_jax.rollout.slice, dora_jax.rl.batch\n"
            "b = sorted(m for m in sys.modules if m.startswith('dora_jax.scheduler'))\n"
            "print(a, b)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "['dora_jax.versions'] []"


def test_mode_registry_is_the_config_list():
    from dora_jax import config
    from dora_jax.scheduler import POLICIES

    assert tuple(POLICIES) == config.MODES


def test_docs_layout_matches_the_package():
    import pathlib
    import re

    repo = pathlib.Path(__file__).resolve().parents[1]
    layout = (repo / "docs" / "layout.md").read_text().split("```")[1]
    block = layout.split("\nconfigs/")[0]  # the dora_jax/ part
    listed = set(re.findall(r"^  (\w+(?:\.py|/))", block, flags=re.M))
    actual = {p.name + ("/" if p.is_dir() else "") for p in (repo / "dora_jax").iterdir()
              if p.name not in ("__init__.py", "__pycache__")}
    assert listed == actual


def _loaded(code: str) -> list:
    """The project modules loaded once `code` ran, in a fresh interpreter."""
    code += "\nimport sys\nprint(sorted(m for m in sys.modules if m.startswith('dora_jax')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    return ast.literal_eval(out)


def _heavy_loaded(code: str) -> list:
    code += (f"\nimport sys\nprint(sorted({{m.split('.')[0] for m in sys.modules}} & "
             f"set({HEAVY!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    return ast.literal_eval(out)


SCHEDULER = ("core", "driver", "dora", "invariants", "ledger", "modes", "partial",
             "policies", "types")


def test_scheduler_imports_no_jax_runtime_or_rollout():
    code = "import " + ", ".join(f"dora_jax.scheduler.{m}" for m in SCHEDULER)
    loaded = _loaded(code)
    assert not [m for m in loaded if m.startswith(("dora_jax.runtime", "dora_jax.rollout",
                                                   "dora_jax.sim", "dora_jax.model"))], loaded
    assert _heavy_loaded(code) == []


def test_rewards_import_no_runtime_rollout_or_scheduler():
    loaded = _loaded("import dora_jax.rewards.tokens, dora_jax.rewards.verifiers, "
                     "dora_jax.rewards.shaping, dora_jax.rewards.pool")
    assert not [m for m in loaded if m.startswith(("dora_jax.runtime", "dora_jax.rollout",
                                                   "dora_jax.scheduler"))], loaded
    assert _heavy_loaded("import dora_jax.rewards.tokens, dora_jax.rewards.shaping") == []


def test_config_is_the_ground_floor_even_when_validating():
    """Validating reads no file and reaches no wing: nothing of model/, rollout/,
    runtime/ or data/'s file readers (the pretrained files are model/hf_checks.py's);
    only the pure scheduler, whose policies say what each mode can do."""
    loaded = _loaded("from dora_jax import config\n"
                     f"config.validate(config.load({str(REPO / 'configs' / 'tiny.py')!r}))")
    assert not [m for m in loaded if m.startswith(("dora_jax.model", "dora_jax.rollout",
                                                   "dora_jax.runtime", "dora_jax.data"))], loaded
    assert not [m for m in loaded if m.startswith("dora_jax.")
                and not m.startswith(("dora_jax.config", "dora_jax.schema",
                                      "dora_jax.scheduler", "dora_jax.versions"))], loaded


def test_versions_imports_nothing_of_the_project():
    assert _loaded("import dora_jax.versions") == ["dora_jax", "dora_jax.versions"]


def test_sharding_imports_no_runtime():
    loaded = _loaded("import dora_jax.model.sharding")
    assert not [m for m in loaded if m.startswith("dora_jax.runtime")], loaded
