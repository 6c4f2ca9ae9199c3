"""One run as several processes on this machine: the trainer's lead, T-1 more
trainer processes (--trainer_processes=T, one SPMD program over the trainer's mesh)
and the slice processes, each a `python -m dora_jax.main` with its role in its
environment (runtime/roles.py).

    python -m dora_jax.launch.local --processes=3 -- --config=configs/tiny.py \\
        --workdir=/tmp/dora_3p

On a CPU each process fakes the devices of its part (its share of the trainer's, or
its slices'). A slice process that dies while the run goes on is started again (as a
JobSet restarts a pod), up to --restarts times; the run regenerates what it held. A
trainer process other than the lead that dies ends the trainer's `jax.distributed`
world: every process is stopped and started again, and the run resumes from its last
checkpoint (as a JobSet restarts the whole job), within the same --restarts. The exit
code is the lead's; the other processes stop with it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from absl import app, flags

from dora_jax.runtime import roles, wire

RESTART_GRACE = 5.0  # seconds a process stopped for a restart has to end on its own

_PROCESSES = flags.DEFINE_integer("processes", 3, "processes: the trainer's lead and "
                                  "N-1 slice processes", lower_bound=2)
_RESTARTS = flags.DEFINE_integer("restarts", 3, "times a dead slice process is started "
                                 "again while the run goes on (and, for a dead trainer "
                                 "process, the whole run)", lower_bound=0)
_TRAINERS = flags.DEFINE_integer("trainer_processes", 1, "of them, processes running the "
                                 "trainer (one SPMD program; the lead is one)",
                                 lower_bound=1)
_HOST = flags.DEFINE_string("host", "127.0.0.1", "where the lead listens")


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def environments(n: int, host: str, port: int, base: dict | None = None,
                 trainer_processes: int = 1) -> list[dict]:
    """Each process's environment: its role and the run's key."""
    base = dict(os.environ if base is None else base)
    key = wire.new_authkey()
    return [dict(base, **{roles.NUM_PROCESSES: str(n), roles.PROCESS_ID: str(p),
                          roles.COORDINATOR: f"{host}:{port}", wire.AUTHKEY_ENV: key,
                          roles.TRAINER_PROCESSES: str(trainer_processes)})
            for p in range(n)]


def free_ports(host: str, count: int) -> int:
    """A port P with P..P+count-1 free (the lead listens on several)."""
    for _ in range(100):
        port = free_port(host)
        try:
            for k in range(1, count):
                with socket.socket() as s:
                    s.bind((host, port + k))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports on {host}")


def run(main_args: list, n: int, restarts: int, host: str = "127.0.0.1",
        log=print, trainer_processes: int = 1) -> int:
    if not 1 <= trainer_processes < n:
        raise SystemExit(f"error: --trainer_processes={trainer_processes} must be 1.."
                         f"{n - 1}: the decode slices need a process of their own")
    envs = environments(n, host, free_ports(host, 3), trainer_processes=trainer_processes)
    cmd = [sys.executable, "-m", "dora_jax.main", *main_args]
    procs = [subprocess.Popen(cmd, env=env) for env in envs]
    left = {p: restarts for p in range(1, n)}
    runs_left = restarts
    try:
        while True:
            lead_rc = procs[0].poll()
            lost = [p for p in range(1, trainer_processes) if procs[p].poll() not in (None, 0)]
            # A lost trainer process ends the trainer's world: the run starts again. (The
            # lead may notice first and exit too; a lead that fails on its own takes
            # the others down with an exit code, not a signal.)
            if lost and (lead_rc is None or any(procs[p].returncode < 0 for p in lost)):
                rc = procs[lost[0]].returncode
                if runs_left == 0:
                    log(f"trainer process {lost[0]} exited ({rc}) and has no restarts left")
                    _stop(procs, everyone=True)
                    return procs[0].returncode or 1
                runs_left -= 1
                log(f"trainer process {lost[0]} exited ({rc}): starting the run again, "
                    f"which resumes ({runs_left} restart(s) left)")
                # Their trainer's world is gone: the others wait at its barriers for the
                # lost process (JAX's preemption notifier takes SIGTERM), so soon a kill.
                _stop(procs, everyone=True, grace=RESTART_GRACE)
                procs = [subprocess.Popen(cmd, env=env) for env in envs]
                continue
            if lead_rc is not None:
                return lead_rc
            for p in range(trainer_processes, n):
                rc = procs[p].poll()
                if rc is None or rc == 0 or left[p] < 0:  # running, told to stop, or given up
                    continue
                if left[p] == 0:
                    log(f"slice process {p} exited ({rc}) and has no restarts left")
                    left[p] = -1
                    continue
                left[p] -= 1
                log(f"slice process {p} exited ({rc}): starting it again "
                    f"({left[p]} restart(s) left)")
                procs[p] = subprocess.Popen(cmd, env=envs[p])
            time.sleep(0.2)
    finally:
        _stop(procs)
        if procs[0].poll() is None:
            procs[0].kill()


def _stop(procs: list, everyone: bool = False, grace: float = 30.0) -> None:
    """Stops the processes after the lead (all of them if `everyone`): SIGTERM, then
    SIGKILL past `grace` seconds."""
    chosen = procs if everyone else procs[1:]
    for proc in chosen:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in chosen:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv):
    # Stopped itself (a timeout, a scheduler), it stops the processes it started.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(run(argv[1:], _PROCESSES.value, _RESTARTS.value, _HOST.value,
                 trainer_processes=_TRAINERS.value))


if __name__ == "__main__":
    app.run(main)
