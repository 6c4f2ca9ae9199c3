"""The sandbox runs model-written code in a restricted child process.

Tests that attack through a kernel layer run twice where it matters: with the audit
hook (the refusal the model normally sees) and without it, so the kernel layers are
shown to hold on their own.  A kernel-layer test skips only when protections() says
the host lacks that layer.
"""

import ctypes
import os
import pathlib
import resource
import shutil
import socket
import subprocess
import uuid

import pytest

from dora_jax.envs import sandbox
from dora_jax.envs.sandbox import SandboxLimits, protections, run_python

REPO = pathlib.Path(__file__).resolve().parents[1]
BOTH = pytest.mark.parametrize("audit_hook", [True, False], ids=["hook", "kernel-only"])


def need(layer):
    if not protections().get(layer):
        pytest.skip(f"{layer} is not available on this host")


def marker():
    return f"dora_sandbox_test_{uuid.uuid4().hex}"


def surviving(mark):
    """Pids of processes (other than this one) whose command line holds ``mark``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if mark.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def test_protections_report_every_layer():
    layers = protections()
    for name in ("rlimits", "audit_hook", "netns", "landlock", "seccomp"):
        assert name in layers
    assert layers["rlimits"] and layers["audit_hook"]


def _host_offers(layer):
    """Whether the host offers ``layer``, probed here without the sandbox's code."""
    if layer == "landlock":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        return libc.syscall(444, None, 0, 1) >= 1  # landlock_create_ruleset(VERSION)
    if layer == "seccomp":
        try:
            ctypes.CDLL("libseccomp.so.2")
        except OSError:
            return False
        return "Seccomp" in pathlib.Path("/proc/self/status").read_text()
    if layer == "netns":
        unshare = shutil.which("unshare")
        flags = "-n" if os.getuid() == 0 else "-rn"
        return bool(unshare) and subprocess.run(
            [unshare, flags, "true"], capture_output=True).returncode == 0
    raise ValueError(layer)


@pytest.mark.parametrize("layer", ["landlock", "seccomp", "netns"])
def test_layer_used_wherever_host_offers_it(layer):
    # Keeps the kernel-only tests below from skipping silently where they could run.
    if not _host_offers(layer):
        pytest.skip(f"this host does not offer {layer}")
    assert protections()[layer] is True


def test_prints_output():
    result = run_python("x = 37 * 41\nprint('answer', x + 12)")
    assert result.ok and result.error is None
    assert result.stdout == "answer 1529\n"


def test_syntax_error_reported():
    result = run_python("def f(:\n  pass")
    assert not result.ok
    assert result.error.startswith("SyntaxError")
    assert "SyntaxError" in result.stdout
    assert "_sandbox_child" not in result.stdout  # the traceback starts in the code


def test_exception_reported_as_one_line():
    result = run_python("print('before')\nraise KeyError('missing')")
    assert not result.ok
    assert result.error == "KeyError: 'missing'"
    assert result.stdout.startswith("before\n")


def test_infinite_loop_killed_within_timeout():
    limits = SandboxLimits(timeout_s=1.5, cpu_s=30)
    result = run_python("while True:\n    pass", limits)
    assert not result.ok
    assert result.error == "timeout after 1.5 s"
    assert 1.4 <= result.seconds < limits.timeout_s + 2


def test_cpu_limit_stops_busy_code():
    result = run_python("while True:\n    pass", SandboxLimits(timeout_s=20, cpu_s=1))
    assert result.error == "cpu time limit exceeded (1 s)"
    assert result.seconds < 10


@pytest.mark.parametrize("code", [
    "x = bytearray(10**10)",
    "chunks = []\nwhile True:\n    chunks.append(bytearray(10**6))",
], ids=["one-big", "growing-list"])
def test_memory_bomb_fails_with_memory_error(code):
    before = resource.getrlimit(resource.RLIMIT_AS)
    result = run_python(code, SandboxLimits(memory_mb=128))
    assert not result.ok
    assert result.error.startswith("MemoryError")
    # The parent is unaffected: no limit inherited, and it can still allocate.
    assert resource.getrlimit(resource.RLIMIT_AS) == before
    assert len(bytearray(300 * 2**20)) == 300 * 2**20


@BOTH
def test_fork_bomb_contained(audit_hook):
    if not audit_hook:
        need("seccomp")
    mark = marker()
    code = f"# {mark}\nimport os\nwhile True:\n    os.fork()"
    result = run_python(code, SandboxLimits(timeout_s=3), audit_hook=audit_hook)
    assert not result.ok
    assert "PermissionError" in result.error or "refused" in result.error
    assert result.seconds < 3
    assert surviving(mark) == []


@BOTH
@pytest.mark.parametrize("where", ["tmp", "home", "repo"])
def test_write_outside_scratch_refused(where, audit_hook):
    if not audit_hook:
        need("landlock")
    base = {"tmp": pathlib.Path("/tmp"), "home": pathlib.Path.home(), "repo": REPO}[where]
    target = base / f"{marker()}.txt"
    result = run_python(f"open({str(target)!r}, 'w').write('pwned')", audit_hook=audit_hook)
    assert not result.ok
    assert "refused" in result.error or "PermissionError" in result.error
    assert not target.exists()


@BOTH
def test_delete_outside_scratch_refused(tmp_path, audit_hook):
    if not audit_hook:
        need("landlock")
    victim = tmp_path / "keep.txt"
    victim.write_text("keep")
    result = run_python(f"import os\nos.remove({str(victim)!r})", audit_hook=audit_hook)
    assert not result.ok
    assert victim.read_text() == "keep"


def test_write_inside_scratch_works_and_scratch_is_removed():
    code = ("import os\nos.mkdir('d')\nwith open('d/notes.txt', 'w') as f:\n"
            "    f.write('kept')\nprint(open('d/notes.txt').read())\nprint(os.getcwd())")
    result = run_python(code)
    assert result.ok, result.stdout
    text, cwd = result.stdout.splitlines()
    assert text == "kept"
    assert "dora-sandbox-" in cwd and not os.path.exists(cwd)


def test_file_size_limited():
    result = run_python("open('big', 'wb').write(b'x' * (2 * 2**20))", SandboxLimits(max_file_mb=1))
    assert not result.ok
    assert "File too large" in result.error


@BOTH
def test_connect_to_parent_listener_refused(audit_hook):
    if not audit_hook:
        need("seccomp")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)"
        result = run_python(code, audit_hook=audit_hook)
        assert not result.ok
        assert "refused" in result.error or "Error" in result.error
        server.settimeout(0.2)
        with pytest.raises(socket.timeout):
            server.accept()


@BOTH
@pytest.mark.parametrize("family", ["AF_INET", "AF_INET6", "AF_UNIX"])
def test_socket_creation_refused(family, audit_hook):
    if not audit_hook:
        need("seccomp")
    result = run_python(f"import socket\nsocket.socket(socket.{family})", audit_hook=audit_hook)
    assert not result.ok
    assert result.error == "refused: socket" if audit_hook else "PermissionError" in result.error


def test_network_namespace_is_separate():
    need("netns")
    result = run_python("import os\nprint(os.readlink('/proc/self/ns/net'))", audit_hook=False)
    assert result.ok, result.stdout
    assert result.stdout.strip() != os.readlink("/proc/self/ns/net")


def test_capabilities_dropped_when_root():
    if os.getuid() != 0:
        pytest.skip("only root has capabilities to drop")
    code = "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])"
    result = run_python(code, audit_hook=False)
    assert result.ok, result.stdout
    assert int(result.stdout, 16) == 0


@pytest.mark.parametrize("code", [
    "import subprocess\nsubprocess.run(['echo', 'PWNED'])",
    "import os\nos.system('echo PWNED')",
    "import os\nos.execv('/bin/echo', ['echo', 'PWNED'])",
], ids=["subprocess", "os.system", "execv"])
def test_process_creation_refused(code):
    result = run_python(code)
    assert result.error == "refused: process creation"
    assert "PWNED" not in result.stdout


@pytest.mark.parametrize("code", [
    "import subprocess\nsubprocess.run(['echo', 'PWNED'])",
    "import os\nprint('status', os.system('echo PWNED'))",
    "import os\nos.execv('/bin/echo', ['echo', 'PWNED'])",
], ids=["subprocess", "os.system", "execv"])
def test_process_creation_refused_by_kernel(code):
    need("seccomp")
    result = run_python(code, audit_hook=False)
    assert "PWNED" not in result.stdout
    if "os.system" in code:
        assert result.stdout.startswith("status ") and "status 0" not in result.stdout
    else:
        assert result.error.startswith("PermissionError")


def test_ctypes_refused_by_audit_hook():
    result = run_python("import ctypes\nctypes.CDLL(None).getpid()")
    assert result.error == "refused: ctypes"


@BOTH
def test_cannot_signal_parent(audit_hook):
    if not audit_hook:
        need("seccomp")
    # Signal 0 only checks permission, so a failure of the sandbox harms nothing.
    result = run_python(f"import os\nos.kill({os.getpid()}, 0)", audit_hook=audit_hook)
    assert not result.ok
    assert "refused" in result.error or "PermissionError" in result.error


def test_reading_system_files_is_allowed():
    # Only writes, network and process creation are banned; reading is allowed.
    result = run_python("print(open('/etc/passwd').read().splitlines()[0].split(':')[0])")
    assert result.ok, result.stdout
    assert result.stdout.strip() == open("/etc/passwd").read().splitlines()[0].split(":")[0]


def test_cannot_read_parent_environment_through_proc():
    need("landlock")
    result = run_python(f"print(open('/proc/{os.getpid()}/environ').read())", audit_hook=False)
    assert not result.ok
    assert "PermissionError" in result.error


def test_output_truncated():
    limits = SandboxLimits(max_output_bytes=100)
    result = run_python("import sys\nfor _ in range(10000):\n    print('y' * 99)", limits)
    assert result.ok
    assert result.stdout.startswith("y" * 99 + "\n")
    assert result.stdout.endswith("[output truncated]")
    assert len(result.stdout.encode()) <= 100 + len(sandbox._TRUNCATED)


def test_output_bytes_decoded_with_replacement():
    result = run_python("import sys\nsys.stdout.buffer.write(b'ok\\xff\\n')")
    assert result.ok
    assert result.stdout == "ok\ufffd\n"


def test_long_code_refused_without_a_process(monkeypatch):
    def no_process(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    limits = SandboxLimits(max_code_chars=50)
    result = run_python("print(1)\n" + "#" * 60, limits)
    assert not result.ok
    assert result.error == "refused: code longer than 50 characters"


def test_parent_environment_not_visible(monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("DORA_SANDBOX_SECRET", secret)
    result = run_python("import os\nprint(sorted(os.environ.items()))")
    assert result.ok
    assert secret not in result.stdout and "DORA_SANDBOX_SECRET" not in result.stdout


def test_threads_still_work():
    code = ("import threading\nout = []\nt = threading.Thread(target=out.append, args=(7,))\n"
            "t.start(); t.join()\nprint(out)")
    result = run_python(code)
    assert result.ok, result.stdout
    assert result.stdout == "[7]\n"
