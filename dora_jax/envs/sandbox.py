"""Run model-written Python where it cannot reach the host.

Under RL the code is an adversary's: only the kernel and the process boundary are
trusted, nothing inside the child's interpreter. Each call starts a fresh interpreter
(``python -I -S -B``, clean environment, own session) on ``_sandbox_child.py``, which
isolates itself before the code runs. Two isolation levels:

- ``namespaces`` (the default): own user namespace (the child's root is an
  unprivileged host uid), pid namespace (the code is pid 1; nothing it starts
  outlives it), mount namespace on a minimal read-only root (the interpreter's stdlib
  and shared libraries, /dev/null, /dev/zero, /dev/urandom, and a size-capped tmpfs
  /scratch as cwd and HOME; no /tmp, /proc, /run, home, repository or host socket),
  empty network, IPC and UTS namespaces; capabilities dropped, no_new_privs,
  rlimits (address space, CPU, file size, files, tasks); Landlock where the host has
  it; a seccomp allow-list (``_sandbox_filters.py``; anything else fails, other ABIs
  kill the process).
- ``filters``, for hosts without user namespaces, chosen explicitly: Landlock
  lets the code read only the interpreter's stdlib and libraries and write nothing
  (no scratch),
  the same seccomp allow-list without threads, capabilities dropped, rlimits.

Fail closed: a layer the level requires and the host lacks stops the call before any
code runs, and ``require`` says so in one line naming the layer and the kernel.
Only stdin (the request), stdout and stderr cross the boundary. The result is what
this process observes: the exit status, its own timer, output read with a bound.
The first output line is the bootstrap's report of the layers it ran under, written
before the code started. The wall-clock timeout kills the process group; the
scratch tmpfs disappears with the child's mount namespace, so no file outlives a
call. At most ``max_sandboxes`` calls run at once in a process.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import selectors
import signal
import subprocess
import sys
import threading
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_CHILD = os.path.join(_HERE, "_sandbox_child.py")
_FILTERS = os.path.join(_HERE, "_sandbox_filters.py")
_TRUNCATED = "\n[output truncated]"
_HEADER = b"\0sandbox "
_MAX_HEADER = 4096
ISOLATION_LEVELS = ("namespaces", "filters")


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0  # wall clock; the whole process group is killed past it
    cpu_s: int = 5  # RLIMIT_CPU
    memory_mb: int = 256  # RLIMIT_AS for the child
    max_output_bytes: int = 4096  # stdout+stderr kept (rest dropped, read bounded)
    max_code_chars: int = 8000  # longer code is refused before any process starts
    max_file_mb: int = 1  # RLIMIT_FSIZE: largest file the code may write
    scratch_mb: int = 8  # the scratch tmpfs's size
    scratch_files: int = 256  # and its inodes
    max_tasks: int = 8  # threads of the call (RLIMIT_NPROC inside its namespaces)
    max_sandboxes: int = 4  # calls at once in this process; more wait up to timeout_s


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    ok: bool
    stdout: str  # stdout and stderr interleaved, as a terminal would show them
    error: str | None  # one line, written by this process: "exit status 1", "timeout after 5.0 s"
    seconds: float
    isolation: str | None = None  # the level the code ran under; None: it did not run
    protections: dict = dataclasses.field(default_factory=dict, compare=False)


class SandboxUnavailable(RuntimeError):
    """The host lacks a layer the isolation level requires (one line)."""


def _refused(reason: str) -> SandboxResult:
    return SandboxResult(ok=False, stdout="", error=f"refused: {reason}", seconds=0.0)


_slots_lock = threading.Lock()
_slots: dict[int, threading.BoundedSemaphore] = {}


def _slot(n: int) -> threading.BoundedSemaphore:
    with _slots_lock:
        return _slots.setdefault(n, threading.BoundedSemaphore(n))


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_bounded(proc: subprocess.Popen, keep: int, deadline: float) -> tuple[bytes, bool, bool]:
    """The child's output until it closes or the deadline: (kept bytes, truncated,
    timed out). Past `keep` bytes output is read and dropped, so the child never
    blocks on a full pipe and memory stays bounded."""
    assert proc.stdout is not None  # opened with stdout=PIPE
    fd = proc.stdout.fileno()
    kept, truncated = bytearray(), False
    with selectors.DefaultSelector() as selector:  # fds may pass FD_SETSIZE
        selector.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(kept), truncated, True
            if not selector.select(min(left, 0.5)):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return bytes(kept), truncated, False
            room = keep - len(kept)
            truncated |= len(chunk) > room
            kept += chunk[:max(room, 0)]


def _exited(pid: int, deadline: float) -> bool:
    """Waits for `pid` to exit, leaving it unreaped (its pid, the group id, cannot be
    reused before the group is killed); False past the deadline."""
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)
    return True


def _split_header(output: bytes) -> tuple[dict | None, bytes]:
    if not output.startswith(_HEADER):
        return None, output
    line, _, rest = output.partition(b"\n")
    try:
        return json.loads(line[len(_HEADER):]), rest
    except ValueError:
        return None, output


def _setup_failure(output: bytes) -> str:
    """Why a child that never ran the code stopped (its bootstrap's own line)."""
    for line in output.decode("utf-8", "replace").splitlines():
        if line.startswith("\0sandbox-refused "):
            layer = line.split(" ", 1)[1].strip()[:60]
            return f"refused: the sandbox needs {layer}, unavailable on Linux {platform.release()}"
        if line.startswith("\0sandbox-error "):
            return f"sandbox failed to start: {line.split(' ', 1)[1].strip()[:200]}"
    return "sandbox failed to start"


def _exit_error(returncode: int, limits: SandboxLimits) -> str | None:
    if returncode == 0:
        return None
    if returncode > 0:
        return f"exit status {returncode}"
    sig = -returncode
    if sig == signal.SIGXCPU:
        return f"cpu time limit exceeded ({limits.cpu_s} s)"
    if sig == signal.SIGKILL:
        return f"killed: cpu time ({limits.cpu_s} s) or memory limit"
    if sig == signal.SIGSYS:
        return "killed: a system call of another ABI"
    return f"killed by signal {signal.Signals(sig).name}"


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *,
               isolation: str = "namespaces", _missing: tuple = ()) -> SandboxResult:
    """Runs `code` under `isolation` and returns what it printed.

    `_missing` names layers to treat as absent (simulating a weaker host, for tests
    and bench.sandbox): "user_ns", "seccomp", "landlock", "landlock_scoping".
    """
    if isolation not in ISOLATION_LEVELS:
        raise ValueError(f"isolation must be one of {ISOLATION_LEVELS}, got {isolation!r}")
    if not isinstance(code, str):
        return _refused("code is not a string")
    if len(code) > limits.max_code_chars:
        return _refused(f"code longer than {limits.max_code_chars} characters")
    if "\x00" in code:
        return _refused("NUL character in code")
    request = json.dumps({
        "code": code, "isolation": isolation, "missing": list(_missing), "filters": _FILTERS,
        "limits": {"memory_mb": limits.memory_mb, "cpu_s": limits.cpu_s,
                   "fsize_mb": limits.max_file_mb, "scratch_kb": limits.scratch_mb * 1024,
                   "scratch_files": limits.scratch_files, "max_tasks": limits.max_tasks}})
    slot = _slot(limits.max_sandboxes)
    if not slot.acquire(timeout=limits.timeout_s):
        return _refused(f"{limits.max_sandboxes} sandboxes already running")
    try:
        return _run(request, limits)
    finally:
        slot.release()


def _run(request: str, limits: SandboxLimits) -> SandboxResult:
    start = time.monotonic()
    env = {"LC_ALL": "C.UTF-8", "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen(
        [os.path.realpath(sys.executable), "-I", "-S", "-B", _CHILD], cwd="/", env=env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True, close_fds=True)
    assert proc.stdin is not None and proc.stdout is not None  # both opened as pipes
    try:
        try:
            proc.stdin.write(request.encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        deadline = start + limits.timeout_s
        output, truncated, timed_out = _read_bounded(
            proc, limits.max_output_bytes + _MAX_HEADER, deadline)
        if not timed_out:  # output closed; the exit must also come before the deadline
            timed_out = not _exited(proc.pid, deadline)
    finally:
        # Nothing of the call may survive it, whatever happened above.
        _kill_group(proc.pid)
        proc.stdout.close()
        proc.wait()
    seconds = time.monotonic() - start
    header, output = _split_header(output)
    if header is None:
        error: str | None = (f"timeout after {limits.timeout_s} s" if timed_out
                             else _setup_failure(output))
        return SandboxResult(ok=False, stdout="", error=error, seconds=seconds)
    truncated |= len(output) > limits.max_output_bytes
    output = output[:limits.max_output_bytes]
    error = f"timeout after {limits.timeout_s} s" if timed_out else _exit_error(
        proc.returncode, limits)
    text = output.decode("utf-8", errors="replace") + (_TRUNCATED if truncated else "")
    return SandboxResult(ok=error is None, stdout=text, error=error, seconds=seconds,
                         isolation=header.get("isolation"),
                         protections=dict(header.get("layers", {})))


@functools.cache
def _probe(isolation: str, missing: tuple) -> SandboxResult:
    return run_python("pass", isolation=isolation, _missing=missing)


def protections(isolation: str = "namespaces", _missing: tuple = ()) -> dict:
    """The layers a call at `isolation` runs under on this host, as its child
    reported them (probed once); empty if the level cannot run here."""
    return dict(_probe(isolation, tuple(_missing)).protections)


def require(isolation: str = "namespaces", _missing: tuple = ()) -> None:
    """Raises SandboxUnavailable (one line) if a call at `isolation` cannot run here."""
    result = _probe(isolation, tuple(_missing))
    if not result.ok:
        lower = " (data.env_isolation='filters' lowers the requirement)" if (
            isolation == "namespaces") else ""
        raise SandboxUnavailable(f"python tool at isolation '{isolation}': {result.error}{lower}")
