"""Test setup: eight fake CPU devices and a persistent compilation cache, set before
JAX is first imported, and the one way tests load the shipped configs (rooted at the
repository, not the working directory)."""

import os
import pathlib
import shutil
import sys
import tempfile
import time
import warnings

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# The tests' programs are tiny, and LLVM's optimisation of them was most of the suite's
# compile time (a third of the time of a compile-bound test file). XLA's own
# optimisations (fusion, layout, sharding) still run; only the machine code is less
# tuned. XLA's CPU fusion emitters (MLIR) then took half of what was left: the
# elemental emitters compile the same fusions in about half the time (the tiny
# default's first run: 10.9 s of backend compile against 5.7 s). Subprocesses inherit
# these with the rest of XLA_FLAGS.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
SUITE_XLA_FLAGS = f"{DEVICE_COUNT_FLAG}=8 {TEST_XLA_FLAGS}"
os.environ.setdefault("XLA_FLAGS", SUITE_XLA_FLAGS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests build engines and trainers of the same shapes: a persistent compilation
# cache compiles each program once a run. One directory per run, shared by its xdist
# workers and inherited by the subprocesses they start. An entry is a zlib stream with
# a checksum: one torn by a killed or concurrent writer fails to decompress, and JAX
# then warns and compiles again, so no torn bytes reach XLA. Directories of runs over
# six hours old are removed.
_CACHES = pathlib.Path(tempfile.gettempdir(), "dora_jax_test_compile_cache")


def _remove_old_caches(max_age_s: float = 6 * 3600) -> None:
    for old in _CACHES.iterdir() if _CACHES.is_dir() else ():
        try:
            if time.time() - old.stat().st_mtime > max_age_s:
                if old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
                else:  # an entry of the layout before per-run directories
                    old.unlink()
        except OSError:  # another run removed it first
            pass


if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _remove_old_caches()
    # xdist's workers inherit the controller's environment: the controller names the
    # run's directory once.
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(
        _CACHES / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402

from dora_jax import config as config_lib  # noqa: E402  (imports no JAX)
from dora_jax.model import hf_checks
from dora_jax.runtime import compile_times

try:
    import jax  # noqa: F401
except ImportError:  # test_layering's run of the pure packages' tests, without JAX
    pass
else:  # as a run's own processes do (compile_times.use_persistent_cache)
    compile_times.share_entries_across_devices()

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = {"dense": "configs/tiny.py:spread", "moe": "configs/moe.py:tiny"}

# Every program JAX keeps loaded holds a few memory maps of its machine code. A worker
# that runs hundreds of tests keeps thousands of programs in JAX's caches, and at the
# kernel's vm.max_map_count (65530 by default) LLVM cannot map the next one and XLA
# crashes the worker (seen in the compilation cache's serialize and deserialize, where a
# program is mapped). After a test that leaves the worker past half the limit, the
# worker drops JAX's caches: what the next tests need comes back from the persistent
# cache.
def _map_limit() -> int:
    if "DORA_TEST_MAP_LIMIT" in os.environ:  # tests of this guard set a small one
        return int(os.environ["DORA_TEST_MAP_LIMIT"])
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read()) // 2
    except OSError:  # not Linux: no such limit to keep away from
        return 0


_MAP_LIMIT = _map_limit()


def _memory_maps() -> int:
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if not _MAP_LIMIT or "jax" not in sys.modules:
        return
    before = _memory_maps()
    if before > _MAP_LIMIT:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()
        # A warning reaches the run's summary from any worker.
        warnings.warn(f"this worker held {before} memory maps (limit {_MAP_LIMIT}): "
                      f"JAX's caches dropped, {_memory_maps()} left", stacklevel=1)


# The tests of the packages that need no JAX. test_layering runs them (not slow ones) in
# a process where JAX cannot be imported; a session that runs that test as well
# leaves them to it rather than running them twice.
PURE_TEST_DIRS = ("tests/scheduler", "tests/sim")
PURE_RUNNER = ("tests/test_layering.py::"
               "test_the_pure_packages_tests_pass_with_the_accelerator_stack_unimportable")


def pytest_collection_modifyitems(config, items):
    """The slowest tests first (tests/slowest.txt), the rest in their order: with
    xdist's work stealing, the short tests then fill in behind the long ones. The pure
    packages' quick tests go to PURE_RUNNER when it runs too."""
    if any(item.nodeid == PURE_RUNNER for item in items):
        pure = [item for item in items if item.nodeid.startswith(PURE_TEST_DIRS)
                and item.get_closest_marker("slow") is None]
        if pure:
            config.hook.pytest_deselected(items=pure)
            left = set(pure)
            items[:] = [item for item in items if item not in left]
    listed = pathlib.Path(__file__).with_name("slowest.txt").read_text().splitlines()
    rank = {nodeid: i for i, nodeid in enumerate(n for n in listed if not n.startswith("#"))}
    items.sort(key=lambda item: rank.get(item.nodeid, len(rank)))


def env_without_device_count(*drop: str) -> dict:
    """This environment as a CPU host that has not faked its devices: XLA_FLAGS
    without the device count (the suite's other XLA flags kept), less `drop`."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def reference(module: str):
    """The reference implementation's `module` (torch, transformers) for a parity
    test: skipped where it is not installed, but a failure where CI promised it
    (DORA_REQUIRE_REFERENCE=1), so a broken install cannot turn the parity tests
    into skips."""
    if os.environ.get("DORA_REQUIRE_REFERENCE") == "1":
        import importlib

        return importlib.import_module(module)
    return pytest.importorskip(module)


def load_repo_config(spec: str, *, validate: bool = True, num_devices: int | None = None,
                     **overrides):
    """`configs/x.py[:variant]` from the repository root. Overrides are dotted paths
    given with `__` (`model__num_layers=1`). Returns the validated Config, or the
    ConfigDict with `validate=False`."""
    path, _, variant = spec.partition(":")
    c = config_lib.load(str(REPO / path) + (f":{variant}" if variant else ""))
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split("__")
        node = c
        for p in parents:
            node = node[p]
        node[leaf] = value
    return hf_checks.validated(c, num_devices) if validate else c


@pytest.fixture(scope="session")
def load_config():
    """The config loader: `load_config("configs/tiny.py:spread", model__num_layers=1)`."""
    return load_repo_config


@pytest.fixture(params=sorted(TINY), scope="session")
def tiny_cfg(request, load_config):
    """Each tiny model config (dense, MoE) in turn, validated."""
    return load_config(TINY[request.param])


@pytest.fixture(scope="session")
def small_config(load_config):
    """`small_config(mode, **coordinator)`: configs/tiny.py shrunk so that a run
    compiles and trains in seconds (1 layer, 2 slices x 4 slots, 8-token responses);
    `validate=False` gives the ConfigDict; `colocated=True` spreads the trainer and
    the slices over the same 8 devices (config.model.colocate)."""
    def make(mode: str, *, rollout=None, validate=True, colocated=False, **coordinator):
        c = load_config("configs/tiny.py:spread", validate=False)
        if colocated:
            c.mesh.update(config_lib.colocate(c.mesh.to_dict()))
        c.model.num_layers = 1
        if not colocated:  # two slices show every path of several; each compiles
            c.mesh.num_slices = 2
        c.rollout.update(dict(slots_per_slice=4, max_prefill_length=8, max_decode_len=8,
                              prefill_buckets=(8,), decode_steps=4))
        c.rollout.update(rollout or {})
        c.trainer.length_buckets = (c.rollout.max_prefill_length + c.rollout.max_decode_len,)
        c.coordinator.update(dict(mode=mode, group_size=2, train_batch_size=2,
                                  rollout_batch_size=4, max_staleness=1, num_steps=4))
        c.coordinator.update(coordinator)
        c.data.num_prompts = 64
        return hf_checks.validated(c, num_devices=8) if validate else c
    return make


def audit_workdir(cfg, workdir):
    """(ledger events, the project's audit of them under the run's own mode)."""
    from dora_jax.scheduler import SchedulerConfig, ledger

    events = ledger.read(os.path.join(workdir, "ledger.jsonl"))
    return events, ledger.audit_run(events, SchedulerConfig.from_config(cfg),
                                    cfg.rollout.max_decode_len)


def assert_resumed_whole(cfg, workdir, resumes: int = 1) -> list:
    """Asserts a run killed and resumed `resumes` times: one `resume` line each, the ledger audited
    clean, every admitted group consumed once or left, every step trained. Returns
    the standing events."""
    from dora_jax.scheduler import ledger

    events, report = audit_workdir(cfg, str(workdir))
    assert sum(e["event"] == "resume" for e in events) == resumes
    assert report.ok, report.summary()
    standing = ledger.standing(events)
    admitted = {e["group_id"] for e in standing if e["event"] == "admit"}
    consumed = [e["group_id"] for e in standing if e["event"] == "consume"]
    left = {e["group_id"] for e in standing if e["event"] in ("filter", "unconsumed")}
    assert admitted <= set(consumed) | left and len(consumed) == len(set(consumed))
    c = cfg.coordinator
    assert len(consumed) == c.num_steps * c.train_batch_size
    return standing


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory):
    """A Hugging Face checkpoint directory of configs/qwen3_gsm8k.py:tiny's model
    (random weights, seed 0) with the shipped tokenizer: what a user would pass as
    --config.model.checkpoint."""
    from dora_jax.data.word_problems import TOKENIZER_DIR
    from dora_jax.model import hf, transformer
    from dora_jax.text.tokenizer import Tokenizer

    cfg = load_repo_config("configs/qwen3_gsm8k.py:tiny")
    path = tmp_path_factory.mktemp("hf") / "tiny_qwen3"
    _, params = transformer.create(cfg.model, seed=0)
    hf.save_pretrained(cfg.model, params, str(path),
                       tokenizer=Tokenizer.from_pretrained(TOKENIZER_DIR))
    return str(path)
