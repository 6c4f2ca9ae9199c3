"""What a run of several processes costs (docs/processes.md).

    python -m dora_jax.bench.processes [--parts=publish,coordinator] [--reps=5]

- publish: a version's params from the trainer's mesh to a decode slice's, in one
  process (`ParamPlacement.place`, a device_put across meshes) against a slice process
  pulling them over JAX's transfer server (runtime/weight_transfer.py: staged on the
  trainer's devices, then pulled), interleaved and repeated (median); full weights and
  LoRA adapters, at the tiny config's shape and a larger one (8 layers of 1024). The
  cross-process seconds against bytes give the simulator's transfer cost
  (`transfer_latency`, `transfer_bandwidth`: sim/cost.py) for this host.
- gather: a published version (or a checkpoint's state) of a trainer over two
  processes gathered onto the lead (`sharding.gathered`: one program over the
  trainer's `jax.distributed` world, gloo on a CPU) against the same program in one
  process over the same mesh shape; repeated, median.
- coordinator: the coordinator's decisions per second with 8, 32 and 128 slices, its
  real scheduler (dora) and wire (runtime/remote.py) driving fake slice processes
  that answer at once (every submit finished, every load done), so the coordinator
  is the bottleneck; a run needs a decision per finished batch of a slice.

Ends with `cross-process/in-process publish seconds (larger, full): X` (the last
shape's) and
`coordinator decisions/s at 128 slices: Y`.
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import subprocess
import sys
import time

from absl import app, flags

_PARTS = flags.DEFINE_list("parts", ["publish", "gather", "coordinator"],
                           "publish, gather, coordinator")
_REPS = flags.DEFINE_integer("reps", 5, "repeats per publish measurement (median)")
_SHAPES = flags.DEFINE_list("shapes", ["tiny", "larger"], "model shapes to publish")
_SLICES = flags.DEFINE_list("slices", ["8", "32", "128"], "slice counts to drive")
_SECONDS = flags.DEFINE_float("seconds", 5.0, "coordinator measurement per slice count")
_PULLER = flags.DEFINE_string("puller", "", "internal: run as the pulling process")
_FAKE = flags.DEFINE_string("fake_slices", "", "internal: run as a fake slice process")
_GATHERER = flags.DEFINE_string("gatherer", "", "internal: run as a trainer process")

LARGER = dict(d_model=1024, num_layers=8, num_heads=16, num_kv_heads=4, head_dim=64,
              mlp_hidden=2816, vocab_size=32000)


def _config(shape: str, lora: bool):
    from dora_jax import config as config_lib
    from dora_jax.model import hf_checks

    c = config_lib.load("tiny:spread")  # the trainer on 4 devices, sharded
    if shape == "larger":
        c.model.update(LARGER)
    if lora:
        c.model.lora.update(dict(rank=8, alpha=16.0))
    c.mesh.num_slices = 2
    return hf_checks.validated(c, num_devices=8)


# ------------------------------------------------------------------ publish
def _puller(spec: str) -> None:
    """Pulls each offer named on stdin; prints the seconds each took."""
    import jax

    from dora_jax.rollout.placement import ParamPlacement
    from dora_jax.runtime import slice_process
    from dora_jax.runtime.weight_transfer import WeightPuller, start_server

    shape, lora, address = json.loads(spec)
    cfg = _config(shape, lora)
    [mesh] = slice_process.slice_meshes(cfg, 1)
    placement = ParamPlacement(cfg.model, mesh, cfg.mesh.decode_rules)
    puller = WeightPuller(placement, start_server("127.0.0.1"), address)
    print("ready", flush=True)
    for line in sys.stdin:
        number, leaves = json.loads(line)
        start = time.perf_counter()
        jax.block_until_ready(puller.pull(number, leaves).leaves)
        print(time.perf_counter() - start, flush=True)


def publish(shape: str, lora: bool, reps: int) -> dict:
    import jax

    from dora_jax.config import devices
    from dora_jax.model import lora as lora_lib
    from dora_jax.rollout.placement import ParamPlacement
    from dora_jax.runtime import experiment
    from dora_jax.runtime.weight_transfer import WeightOffers, staging_mesh

    cfg = _config(shape, lora)
    trainer_mesh, [slice_mesh, _] = devices.make_meshes(cfg.mesh)
    _, params = experiment.initial_params(cfg, trainer_mesh)
    local = ParamPlacement(cfg.model, slice_mesh, cfg.mesh.decode_rules)
    stage = staging_mesh(list(trainer_mesh.devices.flat), slice_mesh.devices.shape)
    offers = WeightOffers(ParamPlacement(cfg.model, stage, cfg.mesh.decode_rules), "127.0.0.1")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    puller = subprocess.Popen([sys.executable, "-m", "dora_jax.bench.processes",
                               f"--puller={json.dumps([shape, lora, offers.address])}"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert puller.stdout is not None and puller.stdin is not None
    if puller.stdout.readline().strip() != "ready":
        raise RuntimeError("the pulling process did not start")
    in_process, across = [], []
    if lora:  # a run publishes new adapters over the one base (runtime/weights.py)
        base, adapters = lora_lib.split(params)
        versions = [lora_lib.merge(base, jax.tree.map(lambda x, k=k: x + k, adapters))
                    for k in range(reps + 1)]
    else:
        versions = [jax.tree.map(lambda x, k=k: x + k, params) for k in range(reps + 1)]
    jax.block_until_ready(jax.tree.leaves(versions))
    for k, version in enumerate(versions):  # the first of each warms up (compiles, connects)
        start = time.perf_counter()
        jax.block_until_ready(local.place(version).leaves)
        in_s = time.perf_counter() - start
        start = time.perf_counter()
        number, leaves = offers.offer(k, version, base_held=lora and k > 0)
        puller.stdin.write(json.dumps([number, leaves]) + "\n")
        puller.stdin.flush()
        float(puller.stdout.readline())
        if k:
            in_process.append(in_s)
            across.append(time.perf_counter() - start)
    puller.stdin.close()
    puller.wait(timeout=60)
    moved = (lora_lib.tree_bytes(lora_lib.split(params)[1]) if lora
             else sum(x.nbytes for x in jax.tree.leaves(params)))
    in_s, across_s = statistics.median(in_process), statistics.median(across)
    return dict(shape=shape, what="adapters" if lora else "full", bytes=moved,
                in_process_s=in_s, across_s=across_s, in_process_gb_s=moved / in_s / 1e9,
                across_gb_s=moved / across_s / 1e9)


def _placed_params(cfg, mesh):
    """`cfg`'s params on the trainer `mesh` under the trainer's rules (LoRA: adapters)."""
    import jax

    from dora_jax.model import lora as lora_lib
    from dora_jax.rl.trainer import full_param_shardings
    from dora_jax.runtime import experiment

    _, params = experiment.initial_params(cfg, mesh)
    params = jax.device_put(params, full_param_shardings(params, mesh, cfg.mesh.trainer_rules))
    return lora_lib.split(params)[1] if cfg.model.lora.enabled else params


def _timed_copies(params, reps: int, before=lambda k: None) -> list[float]:
    import jax

    from dora_jax.model.sharding import gathered

    seconds = []
    for k in range(reps + 1):  # the first compiles
        before(k)
        start = time.perf_counter()
        jax.block_until_ready(gathered(params))
        if k:
            seconds.append(time.perf_counter() - start)
    return seconds


def _gatherer(spec: str) -> None:
    """Trainer process `pid` of two: gathers the params `reps` times with the other."""
    shape, lora, pid, port, reps = json.loads(spec)
    from dora_jax.config import devices

    devices.join_trainer_processes(("127.0.0.1", port), 2, pid, heartbeat_timeout=60)
    from jax.experimental import multihost_utils

    cfg = _config(shape, lora)
    params = _placed_params(cfg, devices.make_trainer_mesh(cfg.mesh))
    seconds = _timed_copies(params, reps,
                            lambda k: multihost_utils.sync_global_devices(f"gather {k}"))
    if pid == 0:
        print(json.dumps(seconds), flush=True)


def gather(shape: str, lora: bool, reps: int) -> dict:
    import jax

    from dora_jax.config import devices
    from dora_jax.launch.local import free_port

    cfg = _config(shape, lora)
    params = _placed_params(cfg, devices.make_meshes(cfg.mesh)[0])
    one = _timed_copies(params, reps)
    moved = sum(x.nbytes for x in jax.tree.leaves(params))
    del params
    half = cfg.mesh.trainer_devices // 2
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={half}")
    port = free_port("127.0.0.1")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "dora_jax.bench.processes",
         f"--gatherer={json.dumps([shape, lora, pid, port, reps])}"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        for pid in (0, 1)]
    out, _ = procs[0].communicate(timeout=600)
    procs[1].wait(timeout=60)
    if procs[0].returncode:
        raise RuntimeError(f"the trainer processes failed ({procs[0].returncode})")
    two = json.loads(out.strip().splitlines()[-1])
    one_s, two_s = statistics.median(one), statistics.median(two)
    return dict(shape=shape, what="adapters" if lora else "full", bytes=moved,
                one_process_s=one_s, two_processes_s=two_s, two_gb_s=moved / two_s / 1e9)


def transfer_fit(rows: list[dict]) -> tuple[float, float]:
    """(latency s, bandwidth B/s) of the least-squares line seconds = a + bytes / b over
    the cross-process rows."""
    xs, ys = [r["bytes"] for r in rows], [r["across_s"] for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = (sum((x - mx) * (y - my) for x, y in zip(xs, ys))
             / sum((x - mx) ** 2 for x in xs))
    return max(my - slope * mx, 0.0), 1.0 / slope


# ------------------------------------------------------------------ coordinator
def _fake_slices(spec: str) -> None:
    """A slice process that answers at once: each submit finishes in its slice's next
    batch (one `finished` message a slice), each load is done."""
    from dora_jax.rollout.trajectory import Trajectory
    from dora_jax.runtime import wire

    process_id, host, port = json.loads(spec)
    link = wire.connect((host, port))
    link.send("hello", process_id=process_id)
    _, init = link.recv()
    link.send("ready")
    pending: dict[int, list] = {}
    while True:
        kind, m = link.recv()
        if kind == "stop":
            return
        i = int(m.get("slice", -1))
        if kind == "submit":
            r = m["request"]
            pending.setdefault(i, []).append(Trajectory(
                r.group_id, r.prompt_id, r.sample_index, r.version, list(r.prompt_tokens),
                [1] * 8, [-1.0] * 8, [[r.version, 8]], [i], "length", 0.0, 0.0, 0.0))
        elif kind in ("load", "reload", "add"):
            link.send("loaded", slice=i, version=m["version"])
        elif kind == "export":
            link.send("exported", handover=m["handover"], records=[])
        if not link.poll(0):  # a batch a slice: what arrived meanwhile
            for j, done in pending.items():
                if done:
                    link.send("finished", slice=j, trajectories=done, kv_free=None)
            pending = {}


class _NoWeights:
    """Offers without weights: the coordinator part moves none."""

    address = ""

    def offer(self, version, params, *, base_held):
        return 0, []


def coordinator(num_slices: int, seconds: float, per_process: int = 16) -> dict:
    from dora_jax.base.timeline import Timeline
    from dora_jax.launch.local import free_port
    from dora_jax.rollout.trajectory import Request
    from dora_jax.runtime import remote, roles, wire
    from dora_jax.runtime.events import SamplesFinished, VersionLoaded
    from dora_jax.scheduler.core import Scheduler
    from dora_jax.scheduler.driver import Driver
    from dora_jax.scheduler.types import SchedulerConfig

    os.environ.setdefault(wire.AUTHKEY_ENV, wire.new_authkey())
    n = -(-num_slices // per_process)
    address = ("127.0.0.1", free_port("127.0.0.1"))
    role = roles.Role(0, n + 1, address)
    procs = remote.SliceProcesses(address, role.slice_ids_by_process(num_slices),
                                  _NoWeights(), lambda: (0, None))  # type: ignore[arg-type]
    fakes = [subprocess.Popen([sys.executable, "-m", "dora_jax.bench.processes",
                               f"--fake_slices={json.dumps([p, *address])}"])
             for p in range(1, n + 1)]
    procs.wait_ready(120)
    tbs = max(1, num_slices // 2)
    sched = Scheduler(SchedulerConfig(mode="dora", num_slices=num_slices, slots_per_slice=8,
                                      group_size=4, train_batch_size=tbs,
                                      rollout_batch_size=2 * tbs, max_staleness=2))
    events: queue.Queue = queue.Queue()
    t0 = time.perf_counter()
    clock = lambda: time.perf_counter() - t0  # noqa: E731
    workers = [procs.worker(procs.slices[i], events, Timeline(), clock)
               for i in range(num_slices)]
    for w in workers:
        w.start()

    class Coordinator(Driver):
        def admit(self, a):
            pass

        def assign(self, a):
            workers[a.slice_id].submit(Request(a.group_id, a.group_id, a.sample, (1, 2, 3),
                                               a.group_id, a.version))

        def migrate(self, a):
            workers[a.src_slice].migrate([(a.group_id, a.sample)], workers[a.dst_slice])

        def load(self, a, *, interrupt):
            workers[a.slice_id].load(a.version, None, interrupt=interrupt)

        def add_version(self, a):
            workers[a.slice_id].add(a.version, None)

        def evict(self, a):
            workers[a.slice_id].evict(a.version)

        def train(self, a):  # an instant trainer
            events.put(("trained", a.step))

    driver, decisions, finished, steps = Coordinator(), 0, 0, 0
    driver.execute(sched.decide())
    busy_start = time.process_time()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        ev = events.get(timeout=30)
        to_ack = set()
        while True:
            if isinstance(ev, SamplesFinished):
                for t in ev.trajectories:
                    sched.sample_finished(t.group_id, t.sample_index, 8)
                finished += len(ev.trajectories)
                to_ack.add(ev.slice_id)
            elif isinstance(ev, VersionLoaded):
                sched.version_loaded(ev.slice_id, ev.version)
            elif isinstance(ev, tuple):
                sched.step_finished(ev[1])
                steps += 1
            try:
                ev = events.get_nowait()
            except queue.Empty:
                break
        driver.execute(sched.decide())
        decisions += 1
        for i in to_ack:
            workers[i].ack()
    cpu = time.process_time() - busy_start
    procs.close()
    for f in fakes:
        f.wait(timeout=30)
    return dict(slices=num_slices, processes=n, decisions_per_s=decisions / seconds,
                samples_per_s=finished / seconds, steps=steps,
                coordinator_cpu_share=cpu / seconds)


def main(argv):
    del argv
    if _PULLER.value:
        return _puller(_PULLER.value)
    if _FAKE.value:
        return _fake_slices(_FAKE.value)
    if _GATHERER.value:
        return _gatherer(_GATHERER.value)
    if "publish" in _PARTS.value:
        rows = [publish(shape, lora, _REPS.value)
                for shape in _SHAPES.value for lora in (False, True)]
        for r in rows:
            print(f"publish {r['shape']} {r['what']}: {r['bytes'] / 1e6:.2f} MB, in one "
                  f"process {r['in_process_s'] * 1e3:.1f} ms ({r['in_process_gb_s']:.2f} GB/s), "
                  f"across processes {r['across_s'] * 1e3:.1f} ms ({r['across_gb_s']:.2f} GB/s)")
        latency, bandwidth = transfer_fit(rows)
        print(f"simulator transfer cost (cross-process, this host): transfer_latency="
              f"{latency:.4f} s, transfer_bandwidth={bandwidth / 1e9:.2f} GB/s")
    if "gather" in _PARTS.value:
        for shape in _SHAPES.value:
            for lora in (False, True):
                g = gather(shape, lora, _REPS.value)
                print(f"trainer gather {g['shape']} {g['what']}: {g['bytes'] / 1e6:.2f} MB, "
                      f"in one process {g['one_process_s'] * 1e3:.1f} ms, "
                      f"gathered over 2 trainer processes {g['two_processes_s'] * 1e3:.1f} ms "
                      f"({g['two_gb_s']:.2f} GB/s)")
    if "coordinator" in _PARTS.value:
        for n in map(int, _SLICES.value):
            r = coordinator(n, _SECONDS.value)
            print(f"coordinator {n} slices ({r['processes']} slice processes): "
                  f"{r['decisions_per_s']:.0f} decisions/s, {r['samples_per_s']:.0f} samples/s, "
                  f"{r['steps']} steps, coordinator CPU {r['coordinator_cpu_share']:.0%}")
    if "publish" in _PARTS.value:
        big = [r for r in rows if r["what"] == "full"][-1]
        print(f"cross-process/in-process publish seconds ({big['shape']}, full): "
              f"{big['across_s'] / big['in_process_s']:.2f}")
    if "coordinator" in _PARTS.value:
        print(f"coordinator decisions/s at {n} slices: {r['decisions_per_s']:.0f}")


if __name__ == "__main__":
    app.run(main)
