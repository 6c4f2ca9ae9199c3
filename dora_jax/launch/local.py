"""One run as several processes on this machine: the trainer's lead and N-1 slice
processes, each a `python -m dora_jax.main` with its role in its environment
(runtime/roles.py).

    python -m dora_jax.launch.local --processes=3 -- --config=configs/tiny.py \\
        --workdir=/tmp/dora_3p

On a CPU each process fakes the devices of its part (the trainer's, or its slices').
A slice process that dies while the run goes on is started again (as a JobSet
restarts a pod), up to --restarts times; the run regenerates what it held. The exit
code is the lead's; the slice processes stop with it.
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

_PROCESSES = flags.DEFINE_integer("processes", 3, "processes: the trainer's lead and "
                                  "N-1 slice processes", lower_bound=2)
_RESTARTS = flags.DEFINE_integer("restarts", 3, "times a dead slice process is started "
                                 "again while the run goes on", lower_bound=0)
_HOST = flags.DEFINE_string("host", "127.0.0.1", "where the lead listens")


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def environments(n: int, host: str, port: int, base: dict | None = None) -> list[dict]:
    """Each process's environment: its role and the run's key."""
    base = dict(os.environ if base is None else base)
    key = wire.new_authkey()
    return [dict(base, **{roles.NUM_PROCESSES: str(n), roles.PROCESS_ID: str(p),
                          roles.COORDINATOR: f"{host}:{port}", wire.AUTHKEY_ENV: key})
            for p in range(n)]


def run(main_args: list, n: int, restarts: int, host: str = "127.0.0.1",
        log=print) -> int:
    envs = environments(n, host, free_port(host))
    cmd = [sys.executable, "-m", "dora_jax.main", *main_args]
    procs = [subprocess.Popen(cmd, env=env) for env in envs]
    left = {p: restarts for p in range(1, n)}
    try:
        while procs[0].poll() is None:
            for p in range(1, n):
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
        return procs[0].returncode
    finally:
        for proc in procs[1:]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs[1:]:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if procs[0].poll() is None:
            procs[0].kill()


def main(argv):
    sys.exit(run(argv[1:], _PROCESSES.value, _RESTARTS.value, _HOST.value))


if __name__ == "__main__":
    app.run(main)
