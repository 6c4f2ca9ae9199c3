"""A run's persistent compilation cache (runtime/compile_times.use_persistent_cache):
in the workdir unless JAX_COMPILATION_CACHE_DIR names another, an entry cut short or
spliced by a killed run is compiled again, never served, and on CPU one entry serves
the same program on other devices."""

import json
import os
import subprocess
import sys

from conftest import REPO

PROGRAM = """
import os, sys
from dora_jax.runtime import compile_times
path = compile_times.use_persistent_cache(sys.argv[1])
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.tanh(x * 3.0).sum() + jnp.cumsum(x)[-1])
print(path, float(f(jnp.arange(64.0))))
"""


def _run(workdir, env):
    return subprocess.run([sys.executable, "-c", PROGRAM, str(workdir)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_run_keeps_its_programs_in_the_workdir_and_refuses_torn_entries(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    first = _run(tmp_path, env)
    assert first.returncode == 0, first.stderr[-2000:]
    path, value = first.stdout.split()
    assert path == str(tmp_path / "compile_cache")
    entries = [p for p in (tmp_path / "compile_cache").iterdir() if p.is_file()]
    assert entries
    # Cut every entry short, as a run killed while writing would leave it, and
    # splice one into another's tail: each is refused and compiled again.
    for i, entry in enumerate(entries):
        data = entry.read_bytes()
        entry.write_bytes(data[: len(data) // 2] if i % 2 == 0 else data[:40] + data[41:])
    again = _run(tmp_path, env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.split()[1] == value
    # JAX's reader refused each one (its decompressor failed) and compiled again.
    assert again.stderr.count("Error reading persistent compilation cache entry") == len(
        entries), again.stderr


def test_jax_compilation_cache_dir_names_another_place(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE_")}
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "elsewhere")
    out = _run(tmp_path / "run", env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0] == str(tmp_path / "elsewhere")
    assert not (tmp_path / "run" / "compile_cache").exists()
    # kept there too, however quickly it compiled
    assert any(p.name.startswith("jit__lambda") for p in (tmp_path / "elsewhere").iterdir())


ACROSS_DEVICES = """
import json, sys
from dora_jax.runtime import compile_times
compile_times.use_persistent_cache(sys.argv[1])
import jax, jax.numpy as jnp, numpy as np
from jax._src import monitoring
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
events = []
monitoring.register_event_listener(lambda event, **kw: events.append(event))

def run(ids):
    mesh = Mesh(np.array([jax.devices()[i] for i in ids]), ("x",))
    def placed_sum(v):
        return v * 10 + jax.lax.axis_index("x") + jax.lax.psum(v, "x")
    f = jax.jit(jax.shard_map(placed_sum, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("x")))
    mark = len(events)
    y = f(x)
    shards = sorted(y.addressable_shards, key=lambda s: s.index[0].start)
    return dict(value=np.asarray(y).tolist(), devices=[s.device.id for s in shards],
                hits=[e.rsplit("/", 1)[1] for e in events[mark:] if e.endswith(("hits", "misses"))])

print(json.dumps([run(ids) for ids in ([4], [5], [0, 1], [3, 2])]))
"""


def test_slices_of_one_shape_on_other_devices_read_one_entry_and_run_on_their_own(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", ACROSS_DEVICES, str(tmp_path)], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    one_4, one_5, two_01, two_32 = json.loads(out.stdout.splitlines()[-1])
    # each shard v: v * 10 + its place on the mesh + the elementwise sum of the shards
    assert one_4["value"] == one_5["value"] == [0.0, 11.0, 22.0, 33.0]
    assert two_01["value"] == two_32["value"] == [2.0, 14.0, 23.0, 35.0]
    assert [r["devices"] for r in (one_4, one_5, two_01, two_32)] == [[4], [5], [0, 1], [3, 2]]
    assert [r["hits"] for r in (one_4, one_5, two_01, two_32)] == [
        ["cache_misses"], ["cache_hits"], ["cache_misses"], ["cache_hits"]]
    assert len([p for p in (tmp_path / "compile_cache").iterdir()
                if "placed_sum" in p.name]) == 2
