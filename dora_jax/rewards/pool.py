"""Scoring finished samples in worker processes, so that no response can stall or
harm the coordinator.

The policy's text is adversarial by construction: RL optimises whatever the scorer
does. The verifiers never execute it (rewards/verifiers.py), but a response can still
make one compute for minutes (`9^9^9` in math-verify), allocate gigabytes, or hold
the GIL in big-integer work, and a thread-pool timeout can neither fire on time nor
stop such a call. So rewards run in a pebble process pool:

- each call has a hard wall-clock limit (`coordinator.reward_timeout`): past it the
  worker is killed and replaced, and the sample scores 0 with the reason;
- each worker may grow its address space by at most `coordinator.reward_memory_mb`
  beyond what its imports took; a bigger allocation raises MemoryError there, or
  kills the worker, and the sample scores 0 with the reason;
- a response longer than `coordinator.reward_max_response` items (characters of a
  text, ids of a token response) is refused before any parsing;
- while a reward runs, the worker refuses process starts, sockets, ctypes and file
  writes (an audit hook; defence in depth, not a sandbox): an attempt scores 0 and
  is named in the reason;
- closing the pool kills its workers: it never waits on a hung call.

How workers start, and why nothing can connect to them. Each worker is a fresh
interpreter started with multiprocessing's `spawn` method: fork+exec of
`sys.executable`, handed its start data over an anonymous pipe it inherits, then
talking to the coordinator only over pebble's anonymous pipes. No process of the pool
binds or listens on any socket, so no other process, of this user or root, a sandbox
escapee included, even one sharing this host's mount or network namespace, has an
endpoint to connect to. (The forkserver method this replaced listens on a unix socket
in a `pymp-*` temp dir and, on Python 3.11 at least, serves whoever connects: it forks
a child that unpickles what the client sends, which is code execution as the run's
user; tests/rewards/test_pool_endpoints.py shows it.) Never `fork` either: the coordinator runs JAX
threads, and a fork of a threaded process may deadlock. `spawn` rather than a fork
server of our own (one on an inherited socketpair, or checking SO_PEERCRED): it is a
start method pebble and CPython support as they are, with no IPC code here to get
wrong. What is left is process isolation, not an endpoint: whoever may ptrace-read
the coordinator or a worker (root; the same user, where the run's /proc is visible)
can still open their pipes through /proc/<pid>/fd.

The price is the warm start: a forkserver child was a copy of a server that had
imported sympy once; a spawned worker imports the `preload` modules itself, in its
initializer, before its first call. Replacing a worker killed for its time therefore
takes about 2 s at `record_reward`'s preload (math_verify and reasoning_gym; about 0.9 s
for math_verify alone) instead of 0.03 s, on a loaded 2-core host. A replacement
follows a timeout (`coordinator.reward_timeout`, 60 s by default) or a worker's death,
runs in the background while the other workers go on scoring, and does not stall the
coordinator. As under the forkserver, a worker imports the coordinator's `__main__`
module (as `__mp_main__`; not a package's `__main__.py`): a script that makes a pool
does so under `if __name__ == "__main__"`, and keeps JAX out of its top-level imports.
"""

from __future__ import annotations

import concurrent.futures
import functools
import importlib
import math
import multiprocessing
import os
import resource
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import pebble

# (record, response): the response as `_plain` hands it, a text or token ids; each
# function takes the one its records produce.
RewardFn = Callable[[dict, Any], float]

# Audit events a reward has no business raising. `open` is blocked only for writing.
_BLOCKED = frozenset({
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg",
    "socket.connect", "socket.bind", "socket.sendto", "socket.getaddrinfo",
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
    "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link",
    "os.chmod", "os.chown", "os.truncate", "shutil.rmtree", "shutil.copyfile",
    "shutil.move", "webbrowser.open", "urllib.Request",
})
_CLOSED = "reward pool closed before this sample was scored"
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def one_line(error: BaseException) -> str:
    """`Type: message` of an exception, on one line."""
    text = "".join(traceback.format_exception_only(type(error), error)).strip()
    return " ".join(text.split())[:500]


class RewardPool:
    """Scores `(record, response)` with `fn` in `num_workers` worker processes.

    `submit` returns a future of `(reward, error text or None)` at once; the future
    resolves in a pool thread, never in the caller's. `fn` must be picklable (a
    module-level function, or an object of one such as `verifiers.TokenReward`);
    each worker unpickles it once. A call that raises, passes `timeout` seconds
    (0: no limit), exhausts `memory_mb`, kills its worker or touches a blocked
    operation scores 0 with the reason; the run goes on. `submit_many` scores samples
    that finish together in one call per worker (a round trip per sample costs about
    0.14 ms of CPU, most of a cheap reward's cost).
    """

    def __init__(self, fn: RewardFn, num_workers: int = 2, timeout: float = 60.0, *,
                 memory_mb: int = 2048, max_response: int = 1 << 20,
                 preload: Sequence[str] = ()):
        self._timeout = timeout or None
        self._max_response, self._memory_mb = max_response, memory_mb
        preload = tuple(preload) or modules_for(fn)
        self._num_workers, self._batching = num_workers, True
        self._pending: set[concurrent.futures.Future] = set()
        self._lock = threading.Lock()
        self._pool = pebble.ProcessPool(
            max_workers=num_workers, initializer=_init_worker,
            initargs=(fn, memory_mb, preload), context=_context())

    def submit(self, record: dict, response: Sequence) -> concurrent.futures.Future:
        """Future of (reward, error text or None) for one response."""
        return self.submit_many([(record, response)])[0]

    def submit_many(self, items: Sequence[tuple[dict, Sequence]]
                    ) -> list[concurrent.futures.Future]:
        """`submit`'s futures for `(record, response)` pairs, scored in one call per
        worker. A call that runs out of time or loses its worker is scored again one
        sample per call, so each sample's reward or error is its own; after a call runs
        out of time (the samples' total can pass a limit each keeps) the pool scores one
        sample per call from then on."""
        outs, todo = [], []
        for record, response in items:
            out: concurrent.futures.Future = concurrent.futures.Future()
            outs.append(out)
            if len(response) <= self._max_response:
                todo.append((out, record, _plain(response)))
            else:
                out.set_result((0.0, f"response of {len(response)} items is over "
                                     f"coordinator.reward_max_response={self._max_response}; "
                                     "not scored"))
        if not self._batching or len(todo) < 2:
            for args in todo:
                self._schedule(*args)
            return outs
        with self._lock:
            self._pending.update(out for out, _, _ in todo)
        per_call = -(-len(todo) // self._num_workers)
        for i in range(0, len(todo), per_call):
            chunk = todo[i:i + per_call]
            try:
                inner = self._pool.schedule(_score_many, args=([a[1:] for a in chunk],),
                                            timeout=self._timeout)
            except RuntimeError as e:
                for out, _, _ in chunk:
                    self._resolve(out, self._unscheduled(e))
                continue
            inner.add_done_callback(functools.partial(self._settle_many, chunk=chunk))
        return outs

    def _schedule(self, out: concurrent.futures.Future, record: dict, response) -> None:
        with self._lock:
            self._pending.add(out)
        try:
            inner = self._pool.schedule(_score, args=(record, response), timeout=self._timeout)
        except RuntimeError as e:  # a retry from a pool thread can come after close
            self._resolve(out, self._unscheduled(e))
            return
        inner.add_done_callback(lambda f: self._resolve(out, self._settle(f)))

    def _unscheduled(self, error: RuntimeError) -> tuple[float, str]:
        return 0.0, (one_line(error) if self._pool.active else _CLOSED)

    def _settle_many(self, future, chunk: list) -> None:
        try:
            results = future.result()
        except (TimeoutError, pebble.ProcessExpired) as e:
            if isinstance(e, TimeoutError):
                self._batching = False
            for args in chunk:
                self._schedule(*args)
            return
        except BaseException:  # noqa: BLE001 — the pool's reason, for every sample
            results = [self._settle(future)] * len(chunk)
        for (out, _, _), result in zip(chunk, results):
            self._resolve(out, result)

    def _resolve(self, out: concurrent.futures.Future, result: tuple) -> None:
        with self._lock:
            if out not in self._pending:  # closing resolved it first
                return
            self._pending.discard(out)
        out.set_result(result)

    def _settle(self, future) -> tuple[float, str | None]:
        try:
            return future.result()
        except TimeoutError:
            return 0.0, f"reward timed out after {self._timeout:g} s (worker killed)"
        except pebble.ProcessExpired as e:
            return 0.0, (f"reward worker died (exit code {e.exitcode}); a call past "
                         f"coordinator.reward_memory_mb={self._memory_mb} can end so")
        except (concurrent.futures.CancelledError, concurrent.futures.BrokenExecutor):
            return 0.0, _CLOSED
        except Exception as e:  # noqa: BLE001 — a pickling or pool failure is data too
            return 0.0, one_line(e)

    def close(self) -> None:
        """Kills the workers (a hung call is not waited for) and resolves every
        pending future."""
        self._pool.stop()
        self._pool.join(timeout=10)
        # A stopped pebble pool leaves the futures of unfinished calls pending.
        for out in list(self._pending):
            self._resolve(out, (0.0, _CLOSED))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _plain(response: str | Sequence) -> str | list[int]:
    return response if isinstance(response, str) else [int(t) for t in response]


def when_all_done(futures: list, callback: Callable[[], None]) -> None:
    """Calls `callback` once, in the thread that completes the last of `futures`
    (so that whoever waits for a whole group's rewards never blocks)."""
    left, lock = [len(futures)], threading.Lock()

    def done(_):
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            callback()

    for f in futures:
        f.add_done_callback(done)


def _context():
    """The `spawn` context: a worker is a fresh interpreter on inherited pipes, so no
    listening socket exists for another process to reach (module docstring)."""
    return multiprocessing.get_context("spawn")


def modules_for(fn) -> tuple[str, ...]:
    """Heavy modules `fn` imports on its first call, to import when a worker starts
    (so that a worker's first call is not charged for them)."""
    reward = getattr(fn, "reward", fn)
    name = getattr(reward, "__name__", "")
    wanted = {"math_reward": ("math_verify",), "reasoning_gym_reward": ("reasoning_gym",),
              "record_reward": ("math_verify", "reasoning_gym")}
    return wanted.get(name, ())


# ------------------------------------------------------------------ worker side

_fn: RewardFn | None = None
_blocked: list | None = None  # the blocked events of the call in progress


def _writes(args) -> bool:
    _, mode, flags = (tuple(args) + (None, None, None))[:3]
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return isinstance(flags, int) and bool(flags & _WRITE_FLAGS)


def _audit(event: str, args) -> None:
    if _blocked is None:
        return
    if event in _BLOCKED or (event == "open" and _writes(args)):
        _blocked.append(event)
        raise PermissionError(f"{event} is not allowed while scoring a response")


def _limit_memory(memory_mb: int) -> None:
    """Caps the address space at what the worker holds now plus `memory_mb`."""
    if not memory_mb:
        return
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * resource.getpagesize()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + memory_mb * (1 << 20)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _init_worker(fn: RewardFn, memory_mb: int, preload: Sequence[str]) -> None:
    global _fn
    # Below the coordinator's priority: it feeds the accelerators, a score can wait.
    os.nice(10)
    for module in preload:
        importlib.import_module(module)
    _fn = fn
    if sys.platform.startswith("linux"):
        _limit_memory(memory_mb)
    sys.addaudithook(_audit)


def _score_many(items: list) -> list[tuple[float, str | None]]:
    return [_score(record, response) for record, response in items]


def _score(record: dict, response: str | list) -> tuple[float, str | None]:
    """Runs in a worker: (reward, error text or None)."""
    global _blocked
    _blocked = []
    assert _fn is not None  # set by _init_worker in each worker
    try:
        value, error = float(_fn(record, response)), None
    except MemoryError:
        value, error = 0.0, "MemoryError: the reward call ran out of its memory cap"
    except Exception as e:  # noqa: BLE001 — any reward failure is data
        value, error = 0.0, one_line(e)
    finally:
        blocked, _blocked = _blocked, None
    if blocked:
        return 0.0, f"the reward call attempted {', '.join(sorted(set(blocked)))}: blocked"
    if not math.isfinite(value):
        return 0.0, f"the reward call returned {value}"
    return value, error
