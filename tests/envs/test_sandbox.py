"""The python tool's sandbox: model code runs isolated by the kernel, fails closed.

The attacks here go through kernel layers only (nothing in the child's interpreter is
trusted); tests/bench/test_bench_sandbox.py runs the escape corpus of bench.sandbox.
"""

import ctypes
import os
import pathlib
import re
import resource
import subprocess
import threading
import time
import types
import uuid

import pytest

from dora_jax.envs import _sandbox_filters as filters
from dora_jax.envs import sandbox
from dora_jax.envs.sandbox import SandboxLimits, run_python

REPO = pathlib.Path(__file__).resolve().parents[2]
UNISTD = pathlib.Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")


@pytest.fixture(autouse=True, scope="module")
def _host_has_the_default_level():
    try:
        sandbox.require()
    except sandbox.SandboxUnavailable as e:
        pytest.skip(str(e))


def kernel_syscalls() -> dict[str, int]:
    """The kernel's x86_64 syscall table (its uapi header), name -> number."""
    if not UNISTD.exists() or os.uname().machine != "x86_64":
        pytest.skip("needs the x86_64 kernel headers (linux-libc-dev)")
    found = re.findall(r"#define __NR_(\w+) (\d+)", UNISTD.read_text())
    return {name: int(nr) for name, nr in found}


def test_prints_output_and_reports_its_layers():
    result = run_python("x = 37 * 41\nprint('answer', x + 12)")
    assert result.ok and result.error is None and result.isolation == "namespaces"
    assert result.stdout == "answer 1529\n"
    for layer in ("user_ns", "pid_ns", "mount_ns", "net_ns", "ipc_ns", "seccomp",
                  "capabilities", "no_new_privs", "rlimits"):
        assert result.protections[layer] is True, layer


def _status_of_sandboxed_process(code, **kwargs):
    """/proc/<pid>/status of the sandboxed process (pid 1 of a nested pid namespace)
    as the host sees it while `code` runs, and the call's result."""
    seen = []

    def watch():
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline and not seen:
            for entry in os.listdir("/proc"):
                try:
                    status = pathlib.Path(f"/proc/{entry}/status").read_text()
                    cmdline = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes()
                except OSError:
                    continue
                fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
                if b"_sandbox_child" in cmdline and fields.get("NSpid", "").split()[1:] == ["2"] \
                        and fields.get("Seccomp") != "0":
                    seen.append(fields)
                    break
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    result = run_python(code, **kwargs)
    watcher.join()
    assert seen, "the sandboxed process was not found"
    return seen[0], result


def test_layers_reported_are_the_ones_the_host_sees():
    status, result = _status_of_sandboxed_process(
        "import os, time\ntime.sleep(1.0)\n"
        "print(repr((os.getpid(), os.getuid(), sorted(os.listdir('/')))))")
    assert result.ok, result.stdout
    assert status["Seccomp"] == "2" and status["NoNewPrivs"] == "1"
    assert int(status["CapEff"], 16) == int(status["CapPrm"], 16) == int(status["CapBnd"], 16) == 0
    if os.geteuid() == 0:  # the child's root is an unprivileged uid of the host
        from dora_jax.envs import _sandbox_child

        assert set(status["Uid"].split()) == {str(_sandbox_child._OUTER_ID)}
        assert set(status["Gid"].split()) == {str(_sandbox_child._OUTER_ID)}
    assert result.protections["seccomp"] and result.protections["no_new_privs"]
    assert result.protections["capabilities"]
    pid, uid, root = eval(result.stdout)  # noqa: S307 - our own test code's output
    assert pid == 2 and uid == 0  # in its own pid namespace (pid 1 waits), root only there
    assert "scratch" in root and "dev" in root
    assert not {"tmp", "proc", "run", "sys", "home", "var", "mnt", REPO.parts[1]} & set(root), root


def test_exception_shows_its_traceback_and_an_exit_status():
    result = run_python("print('before')\nraise KeyError('missing')")
    assert not result.ok and result.error == "exit status 1"
    assert result.stdout.startswith("before\n")
    assert "KeyError: 'missing'" in result.stdout and "_sandbox_child" not in result.stdout


def test_the_code_cannot_forge_its_report():
    probe = run_python("pass")
    fake = ('import os, sys\nsys.stdout.write("\\0sandbox {\\"isolation\\": \\"none\\", '
            '\\"layers\\": {\\"fake\\": true}}\\n"); sys.stdout.flush()\n'
            'for fd in range(3, 40):\n    try:\n        os.write(fd, b"{\\"error\\": null}\\n")\n'
            '    except OSError:\n        pass\nos._exit(3)')
    result = run_python(fake)
    assert not result.ok and result.error == "exit status 3"
    assert result.isolation == "namespaces" and result.protections == probe.protections


def test_infinite_loop_killed_within_timeout():
    result = run_python("while True:\n    pass", SandboxLimits(timeout_s=1.5, cpu_s=30))
    assert result.error == "timeout after 1.5 s"
    assert 1.4 <= result.seconds < 3.5


def test_cpu_limit_stops_busy_code():
    result = run_python("while True:\n    pass", SandboxLimits(timeout_s=20, cpu_s=1))
    assert result.error == "cpu time limit exceeded (1 s)"


def test_memory_bomb_fails_and_the_parent_is_unaffected():
    before = resource.getrlimit(resource.RLIMIT_AS)
    result = run_python("x = bytearray(10**10)", SandboxLimits(memory_mb=128))
    assert not result.ok and "MemoryError" in result.stdout
    assert resource.getrlimit(resource.RLIMIT_AS) == before


def test_scratch_is_a_capped_tmpfs_that_vanishes():
    before = set(os.listdir("/tmp"))
    code = ("import os\nos.mkdir('d')\nopen('d/n.txt', 'w').write('kept')\n"
            "print(open('d/n.txt').read(), os.getcwd())\n"
            "try:\n    i = 0\n    while True:\n"
            "        open(f'f{i}', 'wb').write(b'x' * 2**19); i += 1\n"
            "except OSError as e:\n    print(e.errno, i)")
    result = run_python(code, SandboxLimits(scratch_mb=2, max_file_mb=1))
    assert result.ok, result.stdout
    first, second = result.stdout.splitlines()
    assert first == "kept /scratch"
    errno, files = map(int, second.split())
    assert errno == 28 and files <= 4  # ENOSPC at the 2 MB cap
    assert set(os.listdir("/tmp")) - before == set()


@pytest.mark.parametrize("path", ["/tmp/x", "/usr/x", "/x", "/dev/x",
                                  str(REPO / "owned"), str(pathlib.Path.home() / "owned")])
def test_nothing_outside_scratch_is_writable_or_even_there(path):
    result = run_python(f"open({path!r}, 'w').write('pwned')")
    assert not result.ok
    assert not os.path.exists(path) or path in ("/tmp/x", "/x")
    assert "Error" in result.stdout


def test_installed_packages_are_not_visible():
    result = run_python("import sysconfig, os\nprint(os.listdir(sysconfig.get_paths()['purelib']))")
    assert result.ok and result.stdout.strip() == "[]", result.stdout


def test_seccomp_allows_only_its_list_of_the_kernels_table():
    table = kernel_syscalls()
    listed = filters.ALLOWED | filters.CONDITIONAL | filters.ENOSYS
    assert listed <= set(table), listed - set(table)
    dangerous = {"socket", "socketpair", "connect", "io_uring_setup", "io_uring_enter",
                 "bpf", "ptrace", "mount", "open_tree", "move_mount", "fsopen", "unshare",
                 "setns", "execve", "execveat", "fork", "vfork", "process_vm_writev",
                 "pidfd_open", "pidfd_getfd", "userfaultfd", "memfd_create", "keyctl",
                 "perf_event_open", "personality", "prctl", "seccomp", "setsid", "setpgid"}
    assert not dangerous & listed
    # Every syscall of the table not on the list fails with EPERM, whatever it is.
    # Arguments of -1 make the calls that the filter would let through fail harmlessly.
    others = sorted(nr for name, nr in table.items() if name not in listed)
    code = (f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"libc.syscall.restype = ctypes.c_long\nbad = []\n"
            f"for nr in {others}:\n    ctypes.set_errno(0)\n"
            f"    if libc.syscall(nr, -1, -1, -1, -1, -1, -1) != -1 or ctypes.get_errno() != 1:\n"
            f"        bad.append((nr, ctypes.get_errno()))\nprint(len({others}), bad)")
    result = run_python(code)
    assert result.ok, result.stdout
    assert result.stdout.strip() == f"{len(others)} []"
    assert len(others) > 200


@pytest.mark.parametrize("code", [
    "import os\nos.kill(os.getppid() or 2, 0)",
    "import os\nos.kill(-1, 0)",
    "import os\nos.fork()",
    "import fcntl, termios\nfcntl.ioctl(1, termios.TIOCSTI, b'x')",
    "import resource\nresource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))",
    "import socket\nsocket.socket(socket.AF_UNIX)",
], ids=["kill-other", "kill-all", "fork", "tiocsti", "set-rlimit", "unix-socket"])
def test_conditional_calls_refused_outside_their_conditions(code):
    result = run_python(code)
    assert not result.ok, result.stdout
    assert "not permitted" in result.stdout or "not allowed" in result.stdout, result.stdout


# i386 `int 0x80` (getpid) and an x32 syscall, as machine code in an executable page.
_OTHER_ABI = {
    "i386": bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]),
    "x32": bytes([0xB8, 39, 0, 0, 0x40, 0x0F, 0x05, 0xC3]),
}


@pytest.mark.parametrize("abi", sorted(_OTHER_ABI))
def test_other_abis_kill_the_process(abi):
    if os.uname().machine != "x86_64":
        pytest.skip("x86_64 machine code")
    code = (f"import ctypes, mmap\nm = mmap.mmap(-1, 4096, prot=7)\nm.write({_OTHER_ABI[abi]!r})\n"
            "f = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))\n"
            "print('returned', f())")
    result = run_python(code)
    assert result.error == "killed: a system call of another ABI"
    assert "returned" not in result.stdout


def test_threads_work_and_are_bounded():
    code = ("import threading, time\nstarted = []\ntry:\n    for _ in range(64):\n"
            "        t = threading.Thread(target=time.sleep, args=(0.5,)); t.start()\n"
            "        started.append(t)\n"
            "except RuntimeError:\n    pass\nprint(len(started))")
    result = run_python(code, SandboxLimits(max_tasks=6))
    assert result.ok, result.stdout
    assert 1 <= int(result.stdout) < 6


def test_sandboxes_at_once_are_bounded():
    limits = SandboxLimits(max_sandboxes=2, timeout_s=20)
    spans = []

    def call():
        r = run_python("import time\na = time.time(); time.sleep(0.4); print(a, time.time())",
                       limits)
        spans.append(tuple(map(float, r.stdout.split())))

    threads = [threading.Thread(target=call) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(spans) == 5
    most = max(sum(a <= t < b for a, b in spans) for t, _ in spans)
    assert most <= 2


@pytest.mark.parametrize("missing,isolation,layer", [
    (("user_ns",), "namespaces", "user_ns"),
    (("seccomp",), "namespaces", "seccomp"),
    (("seccomp",), "filters", "seccomp"),
    (("landlock",), "filters", "landlock"),
])
def test_a_missing_required_layer_refuses_before_any_code_runs(missing, isolation, layer):
    mark = pathlib.Path("/tmp") / f"dora_sandbox_{uuid.uuid4().hex}"
    result = run_python(f"open({str(mark)!r}, 'w')\nprint('ran')", isolation=isolation,
                        _missing=missing)
    assert not result.ok and result.isolation is None and result.stdout == ""
    assert result.error.startswith(f"refused: the sandbox needs {layer}, unavailable on Linux ")
    assert not mark.exists()
    with pytest.raises(sandbox.SandboxUnavailable, match=layer):
        sandbox.require(isolation, _missing=missing)


def test_weaker_landlock_still_runs_at_the_default_level():
    result = run_python("print(1)", _missing=("landlock_scoping",))
    assert result.ok and result.protections["landlock_scoping"] is False


def test_filters_level_reads_but_writes_nothing_and_starts_nothing():
    result = run_python("import json\nprint(json.dumps([1]))", isolation="filters")
    assert result.ok and result.isolation == "filters" and result.stdout == "[1]\n"
    for code in ("open('/tmp/dora_filters_x', 'w')", "import os\nos.fork()",
                 "open('/etc/hostname').read()", "import os\nos.chmod('/etc/hostname', 0o777)",
                 "import threading\nthreading.Thread(target=print).start()",
                 f"open('/proc/{os.getpid()}/environ').read()"):
        result = run_python(code, isolation="filters")
        assert not result.ok, code
    assert not os.path.exists("/tmp/dora_filters_x")


def test_the_run_refuses_to_start_naming_the_field(monkeypatch):
    from dora_jax import config as config_lib
    from dora_jax.runtime import cli

    original = sandbox.require
    monkeypatch.setattr(sandbox, "require", lambda level: original(level, _missing=("user_ns",)))
    with pytest.raises(config_lib.ConfigError) as raised:
        cli._check_sandbox(types.SimpleNamespace(env="python", env_isolation="namespaces"))
    message = str(raised.value)
    assert "data.env_isolation" in message and "user_ns" in message and "\n" not in message
    assert os.uname().release in message
    cli._check_sandbox(types.SimpleNamespace(env="calculator", env_isolation="namespaces"))


def test_output_truncated_and_decoded_with_replacement():
    result = run_python("for _ in range(10000):\n    print('y' * 99)",
                        SandboxLimits(max_output_bytes=100))
    assert result.ok and result.stdout.endswith("[output truncated]")
    assert len(result.stdout.encode()) <= 100 + len(sandbox._TRUNCATED)
    assert run_python("import sys\nsys.stdout.buffer.write(b'ok\\xff\\n')").stdout == "ok\ufffd\n"


def test_long_code_refused_without_a_process(monkeypatch):
    def no_process(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    result = run_python("print(1)\n" + "#" * 60, SandboxLimits(max_code_chars=50))
    assert result.error == "refused: code longer than 50 characters"


def test_parent_environment_not_visible(monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("DORA_SANDBOX_SECRET", secret)
    result = run_python("import os\nprint(sorted(os.environ.items()))")
    assert result.ok and secret not in result.stdout


def test_the_parent_process_cannot_be_reached_through_ctypes_either():
    # ctypes works, but only on the child's own memory: the parent is not addressable.
    code = (f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"print(libc.kill({os.getpid()}, 0), ctypes.get_errno(),"
            f" libc.syscall(310, {os.getpid()}, 0, 1, 0, 1, 0), ctypes.get_errno())")
    result = run_python(code)  # kill(); process_vm_readv()
    assert result.ok and result.stdout.split() == ["-1", "1", "-1", "1"], result.stdout
    assert ctypes.CDLL(None).getpid() == os.getpid()
