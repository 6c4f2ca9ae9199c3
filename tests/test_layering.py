"""The layering the package promises: the scheduling core and the config load without
JAX (the scheduler's tests, its fake driver and the simulator need no accelerator
stack); each layer imports only its own and the layers below it (`LAYERS`, every
import counted: in functions and under TYPE_CHECKING too), the config package lowest
of the core; no import cycle joins two modules; the mode registry matches the config's
list of modes."""

import ast
import os
import pathlib
import re
import subprocess
import sys

import _imports as _imports_lib
import pytest
from conftest import PURE_TEST_DIRS

REPO = pathlib.Path(__file__).resolve().parents[1]
HEAVY = ("jax", "jaxlib", "flax", "grain", "orbax", "optax")


@pytest.mark.parametrize("module", ["dora_jax.config", "dora_jax.scheduler",
                                    "dora_jax.scheduler.ledger", "dora_jax.base.timeline",
                                    "dora_jax.sim", "dora_jax.sim.__main__",
                                    "dora_jax.config.devices", "dora_jax.base.versions"])
def test_pure_modules_import_no_jax(module):
    code = (f"import sys, {module}\n"
            f"heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))\n"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "", f"importing {module} loaded {out}"


@pytest.mark.slow
def test_the_pure_packages_tests_pass_with_the_accelerator_stack_unimportable(tmp_path):
    # A sitecustomize on PYTHONPATH reaches every interpreter the tests start too
    # (the simulator's command line), so no test can lean on JAX by a side door.
    (tmp_path / "sitecustomize.py").write_text(
        f"import sys\nsys.modules.update(dict.fromkeys({HEAVY!r}))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    # The suite leaves these tests to this run (conftest.PURE_TEST_DIRS): each runs once.
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rf", "-m", "not slow",
                          "-p", "no:cacheprovider", *PURE_TEST_DIRS],
                         cwd=REPO, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert re.search(r"\b\d+ passed", run.stdout)


def test_config_imports_only_its_own_modules_from_the_package():
    loaded = _loaded("import dora_jax.config")
    assert [m for m in loaded if not m.startswith("dora_jax.config")] == ["dora_jax"], loaded


def test_versions_encoding_is_ground_floor_and_decode_needs_no_scheduler():
    """One run-length encoding of per-token versions (dora_jax.base.versions) with no
    dependency; the decode slices and the train batch use it without pulling in the
    scheduling core."""
    code = ("import sys, dora_jax.base.versions\n"
            "a = sorted(m for m in sys.modules if m.startswith('dora_jax.'))\n"
            "import dora_jax.rollout.slice, dora_jax.rl.batch\n"
            "b = sorted(m for m in sys.modules if m.startswith('dora_jax.scheduler'))\n"
            "print(a, b)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "['dora_jax.base', 'dora_jax.base.versions'] []"


def test_mode_registry_is_the_config_list():
    from dora_jax import config
    from dora_jax.scheduler import POLICIES

    assert tuple(POLICIES) == config.MODES


def test_policies_have_the_capabilities_of_their_config_row():
    """What validation allows a mode and what its policy does are one table's row."""
    import dataclasses

    from dora_jax import config
    from dora_jax.scheduler import POLICIES

    for mode, caps in config.CAPABILITIES.items():
        row = dataclasses.asdict(caps)
        assert {name: getattr(POLICIES[mode], name) for name in row} == row, mode


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


SCHEDULER = ("core", "driver", "dora", "failures", "invariants", "ledger", "modes",
             "partial", "policies", "types")


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
    runtime/ or data/'s file readers (the pretrained files are model/hf_checks.py's),
    nor the scheduler (what each mode can do is config/modes.py's table)."""
    loaded = _loaded("from dora_jax import config\n"
                     f"config.validate(config.load({str(REPO / 'configs' / 'tiny.py')!r}))")
    assert not [m for m in loaded if m.startswith("dora_jax.")
                and not m.startswith("dora_jax.config")], loaded


def test_versions_imports_nothing_of_the_project():
    assert _loaded("import dora_jax.base.versions") == ["dora_jax", "dora_jax.base",
                                                         "dora_jax.base.versions"]


def test_sharding_imports_no_runtime():
    loaded = _loaded("import dora_jax.model.sharding")
    assert not [m for m in loaded if m.startswith("dora_jax.runtime")], loaded


# Static import graph (ast): the layering promised above, without running any import.

PACKAGE = REPO / "dora_jax"


def test_config_package_imports_nothing_above_it():
    """Every import in dora_jax/config, in functions too: its own modules only, and
    dora_jax.configs (the shipped configs' names, which imports nothing)."""
    files = sorted((PACKAGE / "config").glob("*.py"))
    assert files
    above = {f"{f.name}: {m}" for f in files for m in _imports_lib.imports_of(f, REPO)
             if m != "dora_jax" and not m.startswith(("dora_jax.config.", "dora_jax.configs"))
             and m != "dora_jax.config"}
    assert not above, sorted(above)
    assert _imports_lib.imports_of(PACKAGE / "configs" / "__init__.py", REPO) == set()


# Every import, in functions and under TYPE_CHECKING too (tests/_imports.py): no
# cycle among the modules, and the layers below, each importing only its own and those
# under it.

LAYERS = [
    # Imports nothing of the project but one another.
    # base: versions, turns, buckets, untrusted_files, atomic_files, timeline.
    # configs: the shipped configs' names (configs/__init__.py); the configs themselves
    # (configs.*) are entry points.
    ("floor", ("base", "configs")),
    # The core, without JAX: the typed config (with the devices' plan, config/devices.py),
    # the scheduling core.
    ("core", ("config", "scheduler")),
    # What a run reads and scores: tokenizers, rewards, environments, prompt readers,
    # the tasks built on them.
    ("inputs", ("text", "rewards", "envs", "data", "tasks")),
    # The engine: the model, its checkpoints (model/checkpointing.py), decoding, training.
    ("engine", ("model", "rollout", "rl")),
    # The run: the coordinator and the threads it drives, what the entry points share
    # (runtime/cli.py), the experiment they build (runtime/experiment.py).
    ("run", ("runtime",)),
    # The entry points and the shipped configs: nothing imports them.
    ("entry points", ("main", "sft", "export", "serve", "audit", "bench", "sim", "launch",
                      "configs.*")),
]

# The imports that reach a layer above, each named with its reason.
UPWARD = {
    ("dora_jax.tasks.env", "dora_jax.rollout.episodes"):
        "the env task's demonstration frames observations as the episode runner does, "
        "in a function (test_tasks_import_only_the_layers_below_them)",
    ("dora_jax.tasks.env", "dora_jax.rollout"):
        "the package rollout.episodes runs on the way",
}


def test_no_import_cycle_among_the_modules():
    graph = _imports_lib.import_graph(PACKAGE)
    assert len(graph) > 150 and "dora_jax.scheduler.feasibility" in graph
    assert _imports_lib.report(graph) == ""


def test_each_layer_imports_only_its_own_and_those_below():
    graph = _imports_lib.import_graph(PACKAGE)
    assert _imports_lib.layer_violations(graph, LAYERS, UPWARD) == []
    listed = {name for _, names in LAYERS for name in names} - {"configs.*"}
    actual = {p.stem for p in PACKAGE.iterdir()
              if p.name not in ("__init__.py", "__pycache__") and p.name != "assets"}
    assert listed == actual


def _plant(root: pathlib.Path, files: dict) -> pathlib.Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root / "p"


def test_the_checker_reports_a_circle_made_in_a_function(tmp_path):
    """A circle closed by an import in a function body, one closed under
    TYPE_CHECKING, and one through a relative import in a try block: each found,
    the modules named."""
    package = _plant(tmp_path, {
        "p/__init__.py": "",
        "p/a.py": "from p import b\n",
        "p/b.py": "def f():\n    from . import a\n    return a\n",
        "p/q/__init__.py": "",
        "p/q/c.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                    "    from p.q.d import D\n",
        "p/q/d.py": "try:\n    from .c import C\nexcept ImportError:\n    C = None\n",
        "p/q/e.py": "from .. import a\n",
        "p/alone.py": "import p.q.e\n",
    })
    graph = _imports_lib.import_graph(package)
    assert graph["p.b"] == {"p.a"}
    assert graph["p.q.c"] == {"p.q.d"}
    assert graph["p.q.e"] == {"p.a"}
    assert graph["p.alone"] == {"p.q.e", "p.q"}
    assert _imports_lib.cycles(graph) == [["p.a", "p.b"], ["p.q.c", "p.q.d"]]
    report = _imports_lib.report(graph)
    assert "p.a -> p.b -> p.a" in report and "p.q.c -> p.q.d -> p.q.c" in report
    # The circle broken: the function's import gone, only TYPE_CHECKING's left.
    (package / "b.py").write_text("def f():\n    return 1\n")
    assert _imports_lib.cycles(_imports_lib.import_graph(package)) == [["p.q.c", "p.q.d"]]


def test_the_checker_reports_a_registry_that_imports_its_members(tmp_path):
    """A package __init__ that imports a member which names the package back is a
    circle; a member importing a sibling (its package run first) is not."""
    package = _plant(tmp_path, {
        "p/__init__.py": "",
        "p/reg/__init__.py": "from p.reg import one\nfrom p.reg.base import get\n",
        "p/reg/base.py": "def get(name):\n    return name\n",
        "p/reg/one.py": "from p.reg import base\n",
    })
    assert _imports_lib.cycles(_imports_lib.import_graph(package)) == []
    (package / "reg" / "one.py").write_text("def f():\n    from p.reg import get\n")
    assert _imports_lib.cycles(_imports_lib.import_graph(package)) == [["p.reg", "p.reg.one"]]


def test_the_checker_reports_an_import_up_the_layers(tmp_path):
    package = _plant(tmp_path, {
        "p/__init__.py": "", "p/low/__init__.py": "", "p/high/__init__.py": "",
        "p/low/x.py": "def f():\n    import p.high.y\n",
        "p/high/y.py": "from p.low import x\n",
        "p/high/z.py": "from p.high import y\n",
    })
    graph = _imports_lib.import_graph(package)
    layers = [("low", ("low",)), ("high", ("high",))]
    assert _imports_lib.layer_violations(graph, layers, {}) == [
        "p.low.x imports p.high: low -> high, a layer above it",
        "p.low.x imports p.high.y: low -> high, a layer above it",
        "the packages p.high, p.low import one another"]
    allowed = {("p.low.x", "p.high.y"): "", ("p.low.x", "p.high"): ""}
    assert _imports_lib.layer_violations(graph, layers, allowed) == []
    assert _imports_lib.layer_violations(graph, [("low", ("low",))], {}) == [
        "p.high is in no layer"]


def test_text_is_a_floor_below_tasks_models_and_rollout():
    """Tokenizers and chat templates are read by data/, model/ and rollout/; they import
    nothing of the project but the bounded file reader, in functions too."""
    files = sorted((PACKAGE / "text").glob("*.py"))
    assert {f.name for f in files} >= {"tokenizer.py", "template_sandbox.py"}
    above = {f"{f.name}: {m}" for f in files for m in _imports_lib.imports_of(f, REPO)
             if m not in ("dora_jax", "dora_jax.base.untrusted_files")
             and not m.startswith("dora_jax.text")}
    assert not above, sorted(above)
    graph = _imports_lib.import_graph(PACKAGE)
    assert "dora_jax.text.tokenizer" in graph["dora_jax.data.word_problems"]


def test_a_decode_slice_is_composed_not_mixed_in():
    """DecodeSlice owns its parts (versions, turns, memory, slots) as attributes: no
    base class reaches into its private state."""
    from dora_jax.rollout import DecodeSlice
    from dora_jax.rollout.slice_episodes import EpisodeTurns
    from dora_jax.rollout.slice_versions import ResidentVersions

    assert DecodeSlice.__bases__ == (object,)
    assert EpisodeTurns.__bases__ == ResidentVersions.__bases__ == (object,)


# Tasks (dora_jax/tasks): what the model is asked and how it is scored, above the
# readers, the rewards, the environments and the tokenizer they build on.
TASKS_MAY_IMPORT = ("dora_jax.tasks", "dora_jax.data.", "dora_jax.rewards", "dora_jax.envs",
                    "dora_jax.text", "dora_jax.config")


def test_tasks_import_only_the_layers_below_them():
    """tasks/sources.py looks the run's task up, so no task imports it. The one
    import from further up is in a function: the env task's demonstration frames
    observations as the episode runner does (rollout/episodes.py)."""
    files = sorted((PACKAGE / "tasks").glob("*.py"))
    assert {f.name for f in files} >= {"base.py", "residue.py", "env.py", "sources.py"}
    outside = {f"{f.name}: {m}" for f in files for m in _imports_lib.imports_of(f, REPO)
               if m != "dora_jax" and (not m.startswith(TASKS_MAY_IMPORT)
                                       or m == "dora_jax.tasks.sources")}
    assert outside == {"env.py: dora_jax.rollout.episodes"}, sorted(outside)
    assert not {m for f in files for m in _imports_lib.imports_of(f, REPO, module_level=True)
                if m.startswith("dora_jax.rollout")}


def test_nothing_below_the_tasks_imports_them():
    """The readers, rewards, environments, tokenizer and config know no task, in
    functions too (a verifier scores the record it is handed and reads no record
    builder)."""
    below = [p for name in ("data", "rewards", "envs", "text", "config")
             for p in sorted((PACKAGE / name).glob("*.py"))]
    found = {f"{p.relative_to(PACKAGE)}: {m}" for p in below
             for m in _imports_lib.imports_of(p, REPO)
             if m.startswith("dora_jax.tasks")}
    assert not found, sorted(found)
    rewards = {f"{p.name}: {m}" for p in sorted((PACKAGE / "rewards").glob("*.py"))
               for m in _imports_lib.imports_of(p, REPO)
               if m.startswith(("dora_jax.data", "dora_jax.tasks"))}
    assert not rewards, sorted(rewards)
