"""Run model-written Python in a separate, restricted process.

The parent never executes the code.  It starts a fresh interpreter
(``python -I -S``, clean environment, own session and process group, cwd a fresh
scratch directory removed afterwards) running ``_sandbox_child.py``, which restricts
itself before running the code:

- rlimits: address space, CPU seconds, file size, open files, no core dumps;
- an empty network namespace (``unshare``), unprivileged through a user namespace
    when the process is not root;
- capabilities emptied when the child runs as root;
- Landlock: file-system writes only beneath the scratch directory, no TCP
    bind/connect, no signals to processes outside the sandbox;
- seccomp (libseccomp through ctypes): no fork/vfork/clone-without-CLONE_THREAD/
    execve, no socket(), no ptrace or admin syscalls, no kill() of other processes;
- a ``sys.addaudithook`` hook refusing sockets, process creation, ctypes and
    writes outside the scratch directory with a readable "refused: ..." error.

Each kernel layer is used where the host offers it and skipped where it does not
(``protections()`` says which are active); the wall-clock timeout, which kills the
whole process group with SIGKILL, and the bounded output read do not depend on any.
Reading files is allowed: only writes, network and process creation are banned.
Only the standard library is importable in the child (``-S`` skips site-packages).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")
_TRUNCATED = "\n[output truncated]"


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0  # wall clock; the whole process group is killed past it
    cpu_s: int = 5  # RLIMIT_CPU
    memory_mb: int = 256  # RLIMIT_AS for the child
    max_output_bytes: int = 4096  # stdout+stderr kept (rest dropped, read bounded)
    max_code_chars: int = 8000  # longer code is refused before any process starts
    max_file_mb: int = 1  # RLIMIT_FSIZE: largest file the code may write


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    ok: bool
    stdout: str  # stdout and stderr interleaved, as a terminal would show them
    error: str | None  # one line, e.g. "timeout after 5.0 s", "MemoryError", "refused: socket"
    seconds: float
    protections: dict[str, bool] = dataclasses.field(default_factory=dict, compare=False)


def _refused(reason: str) -> SandboxResult:
    return SandboxResult(ok=False, stdout="", error=f"refused: {reason}", seconds=0.0)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _exited_unreaped(pid: int, deadline: float) -> bool:
    """Waits until ``pid`` has exited, leaving it a zombie; False past the deadline."""
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def _read_bounded(proc: subprocess.Popen, status_fd: int, limits: SandboxLimits,
                  deadline: float) -> tuple[bytes, bool, bytes, bool]:
    """Drains the child's output and status pipes until both close or the deadline.

    Output past ``max_output_bytes`` is read and dropped so the child never blocks on a
    full pipe; memory stays bounded either way.
    """
    out_fd = proc.stdout.fileno()
    kept, truncated, status = bytearray(), False, bytearray()
    # selectors rather than select.select: a busy parent may hold fds past FD_SETSIZE.
    with selectors.DefaultSelector() as selector:
        for fd in (out_fd, status_fd):
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(kept), truncated, bytes(status), True
            for key, _ in selector.select(min(left, 0.5)):
                fd = key.fd
                chunk = os.read(fd, 65536)
                if not chunk:
                    selector.unregister(fd)
                elif fd == out_fd:
                    room = limits.max_output_bytes - len(kept)
                    if len(chunk) > room:
                        truncated = True
                    kept += chunk[:max(room, 0)]
                elif len(status) < 65536:
                    status += chunk
    return bytes(kept), truncated, bytes(status), False


def _parse_status(raw: bytes) -> tuple[dict[str, bool], bool, str | None]:
    """Layers reported by the child, whether it reported an outcome, and the error."""
    layers, finished, error = {}, False, None
    for line in raw.decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        if isinstance(record.get("layers"), dict) and not layers:
            layers = {str(k): bool(v) for k, v in record["layers"].items()}
        elif "error" in record and not finished:
            finished = True
            error = record["error"] if isinstance(record["error"], str) else None
    return layers, finished, error


def _died_error(returncode: int, output: bytes, limits: SandboxLimits) -> str:
    """Why a child died without reporting an outcome itself."""
    if returncode == -signal.SIGXCPU:
        return f"cpu time limit exceeded ({limits.cpu_s} s)"
    if returncode == -signal.SIGKILL:  # the hard RLIMIT_CPU, or the kernel's OOM killer
        return f"killed: cpu time ({limits.cpu_s} s) or memory limit"
    if b"MemoryError" in output or b"Cannot allocate memory" in output or (
        returncode == -signal.SIGABRT
    ):
        return f"MemoryError (memory limit {limits.memory_mb} MB)"
    if returncode < 0:
        return f"killed by signal {signal.Signals(-returncode).name}"
    return f"exited with code {returncode} without reporting"


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *,
               audit_hook: bool = True) -> SandboxResult:
    """Runs ``code`` in a fresh, restricted interpreter and returns what it printed.

    ``audit_hook=False`` leaves only the kernel layers and rlimits in place; it exists so
    tests can check that those hold on their own.
    """
    if not isinstance(code, str):
        return _refused("code is not a string")
    if len(code) > limits.max_code_chars:
        return _refused(f"code longer than {limits.max_code_chars} characters")
    if "\x00" in code:
        return _refused("NUL character in code")
    child_limits = json.dumps({"memory_mb": limits.memory_mb, "cpu_s": limits.cpu_s,
                               "fsize_mb": limits.max_file_mb, "audit_hook": audit_hook})
    scratch = tempfile.mkdtemp(prefix="dora-sandbox-")
    status_r, status_w = os.pipe()
    start = time.monotonic()
    try:
        env = {"LC_ALL": "C.UTF-8", "HOME": scratch, "TMPDIR": scratch, "PATH": "/usr/bin:/bin"}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", _CHILD, str(status_w), child_limits, code],
                cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, pass_fds=(status_w,), start_new_session=True,
                close_fds=True)
        finally:
            os.close(status_w)
        try:
            deadline = start + limits.timeout_s
            output, truncated, raw_status, timed_out = _read_bounded(
                proc, status_r, limits, deadline)
            if not timed_out:  # pipes closed; the exit must also come before the deadline
                timed_out = not _exited_unreaped(proc.pid, deadline)
        finally:
            # Past the deadline, or after a normal exit in case anything in the group
            # outlived the leader: nothing of the child's may survive this call.  The
            # leader is not reaped yet, so its pid (the group id) cannot be reused.
            _kill_group(proc.pid)
            proc.stdout.close()
            proc.wait()
        seconds = time.monotonic() - start
    finally:
        os.close(status_r)
        shutil.rmtree(scratch, ignore_errors=True)

    layers, finished, error = _parse_status(raw_status)
    if timed_out:
        error = f"timeout after {limits.timeout_s} s"
    elif not finished and proc.returncode != 0:  # a plain os._exit(0) counts as success
        error = _died_error(proc.returncode, output, limits)
    text = output.decode("utf-8", errors="replace") + (_TRUNCATED if truncated else "")
    return SandboxResult(ok=error is None, stdout=text, error=error, seconds=seconds,
                         protections=layers)


@functools.lru_cache(maxsize=1)
def protections() -> dict[str, bool]:
    """Which protection layers the sandbox manages to apply on this host.

    Probed once by running an empty program; rlimits, the audit hook, the clean
    environment, the scratch directory and the process-group kill are always present.
    """
    result = run_python("pass")
    layers = dict(result.protections)
    layers.setdefault("rlimits", False)
    layers.setdefault("audit_hook", False)
    return layers
