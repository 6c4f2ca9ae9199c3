"""How long a run's warm-up compiles took, per phase: kept in the workdir so the next
run there can say beforehand how long it will be silent."""

from __future__ import annotations

import contextlib
import copy
import os
import time
from collections.abc import Iterator
from typing import Any

from dora_jax.base import atomic_files

FILE = "compile_seconds.json"


def previous(workdir: str) -> dict[str, float] | None:
    """The seconds per phase the last warm-up in `workdir` took, or None (none was
    measured there, or the file is damaged)."""
    try:
        times = atomic_files.read_json_object(os.path.join(workdir, FILE))
    except (OSError, atomic_files.DamagedFile):
        return None
    if not times or not all(isinstance(v, int | float) for v in times.values()):
        return None
    return times


def announcement(phases: list[str], workdir: str) -> str:
    """The line printed before compiling `phases`: the time the last run in `workdir`
    measured, or that there is none."""
    times = previous(workdir)
    when = ("first run: timing unknown" if times is None else
            f"about {sum(times.values()):.0f} s on this host, as the last run here took")
    return f"compiling: {', '.join(phases)} ({when})"


class Stopwatch:
    """Seconds per named phase: `with watch("train step"): ...`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def summary(self) -> str:
        """`compiled in 41 s: train step 12.3 s, ...`."""
        total = sum(self.seconds.values())
        return f"compiled in {total:.0f} s: " + ", ".join(
            f"{phase} {s:.1f} s" for phase, s in self.seconds.items())

    def save(self, workdir: str) -> None:
        atomic_files.write_json_atomic(os.path.join(workdir, FILE),
                                {k: round(v, 3) for k, v in self.seconds.items()}, indent=1)


CACHE_DIR = "compile_cache"


def use_persistent_cache(workdir: str) -> str | None:
    """Keeps the programs a run compiles in `workdir`/compile_cache, so that the same
    command again (a resume) reads them instead of compiling (JAX's persistent
    compilation cache; JAX_COMPILATION_CACHE_DIR, when set, names another directory).
    Returns the directory. An entry cut short by a killed run is refused by its
    decompressor (a zlib stream's checksum, a zstd frame's length) and compiled again,
    never served (tests/runtime/test_compile_cache.py)."""
    import jax

    share_entries_across_devices()
    # Every program, wherever the cache is: a resume compiles nothing it compiled
    # before, the small ones too (unless the environment sets these limits itself).
    for name, value in (("jax_persistent_cache_min_compile_time_secs", 0.0),
                        ("jax_persistent_cache_min_entry_size_bytes", 0)):
        if name.upper() not in os.environ:
            jax.config.update(name, value)
    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    path = os.path.join(workdir, CACHE_DIR)
    jax.config.update("jax_compilation_cache_dir", path)
    return path


def share_entries_across_devices() -> bool:
    """Keys this process's persistent-cache entries on CPU without the devices a
    program runs on, as JAX already keys them on GPU. Decode slices are meshes of the
    same shape on different devices: each compiled the same programs again (the tiny
    default's 4 slices, 4 times). An entry is loaded with the caller's own device
    assignment, so it runs where the caller's program runs. Programs that span
    processes keep JAX's key: JAX shares those between processes by key in memory.
    Returns whether the keys are now shared (False where this JAX has no such hook)."""
    import numpy as np
    from jax._src import cache_key, compilation_cache
    from jax._src.lib import xla_client

    get = cache_key.get
    if getattr(get, "_devices_left_out", False):
        return True
    if getattr(compilation_cache, "cache_key", None) is not cache_key:
        return False

    def get_without_devices(module: Any, devices: Any, compile_options: Any, backend: Any,
                            *args: Any, **kwargs: Any) -> str:
        assignment = compile_options.device_assignment
        if (backend.platform == "cpu" and assignment is not None
                and len({d.process_index for d in devices.flat}) == 1):
            compile_options = copy.deepcopy(compile_options)
            shape = (assignment.replica_count(), assignment.computation_count())
            compile_options.device_assignment = xla_client.DeviceAssignment.create(
                np.arange(shape[0] * shape[1]).reshape(shape))
        return get(module, devices, compile_options, backend, *args, **kwargs)

    get_without_devices._devices_left_out = True  # type: ignore[attr-defined]
    setattr(cache_key, "get", get_without_devices)  # noqa: B010  (a module's attribute)
    return True
