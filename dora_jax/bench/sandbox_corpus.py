"""Escape attempts against envs/sandbox.py, written as the attacker who controls the code.

Each case is a code template; the bench (bench/sandbox.py) replaces placeholders with
paths and endpoints of its own process: `{sentinel}` (a host file only an escape can
create), `{mark}` (a name the bench looks for in /tmp, /dev/shm, /var/tmp, the
repository and HOME after the call), `{pid}`/`{pgid}` (the bench, which trips on
SIGWINCH and SIGURG), `{unix}`, `{abstract}`, `{port}`, `{fifo}` (listeners that trip
on any connection, a FIFO whose writer trips when a reader appears), `{target}` (a
host file whose mode and times the bench checks), `{repo}`, `{home}`. A trip creates
the running case's sentinel. The code also prints `ESCAPED <what>` when an operation
the layers must stop succeeded, which counts as an escape even where nothing on the
host shows it (a namespace hides the sentinel path).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from dora_jax.bench.sandbox_syscalls import GUARDS, OTHER_ABI, PRELUDE, SYSCALLS
from dora_jax.bench.sandbox_verdicts import (
    at_most_max_sandboxes,
    bounded,
    contained,
    failed,
    killed_other_abi,
    no_error,
    refused,
    same_status,
    unaffected,
)

RAN, REFUSED = "ran, contained", "refused at start"
CLASSES = ("guards", "syscalls", "host_ipc", "weaker_hosts", "cleanup_forge", "exhaustion")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kind: str  # one of CLASSES
    code: str
    isolation: str = "namespaces"
    missing: tuple = ()
    expect: str = RAN
    check: Callable = contained
    via_env: bool = False  # through PythonArithmetic.step, as the model reaches it
    limits: tuple = ()  # SandboxLimits overrides, (name, value) pairs
    linger: float = 0.05  # seconds the bench waits before looking for what is left
    parallel: int = 1  # calls at once from threads
    trigger: str = "write"  # how the control fires the sentinel from the bench itself


_HOST_IPC = r'''
import socket, stat
paths = ["{unix}"]
for top in ("/tmp", "/run", "/var/run", "/dev/shm", "/var/tmp"):
    for root, dirs, files in os.walk(top):
        if root.count("/") > 3 or len(paths) > 300:
            dirs[:] = []
        for f in files:
            p = os.path.join(root, f)
            try:
                if stat.S_ISSOCK(os.lstat(p).st_mode):
                    paths.append(p)
            except OSError:
                pass
for p in paths + ["\0{abstract}"]:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        attempt("unix " + p, lambda p=p, k=kind: socket.socket(socket.AF_UNIX, k).connect(p))
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=0.5))
addr = (ctypes.c_ushort * 55)(1, *[ord(c) for c in "{unix}"])
fd = sc(41, 1, 1, 0)
hit("raw connect", sc(42, fd, addr, 110) if fd >= 0 else -1)
for fd in range(3, 64):
    attempt(f"fd {fd}", lambda fd=fd: os.write(fd, b"cos\nsystem\n"))
'''
# A FIFO is an endpoint a host process waits on; opening it for reading alone is
# contact (the writer's open succeeds), and reading is what Landlock allows.
_FIFO = '''
attempt("fifo", lambda: os.open("{fifo}", os.O_RDONLY | os.O_NONBLOCK))
attempt("fifo via proc", lambda: os.open("/proc/self/root{fifo}", os.O_RDONLY | os.O_NONBLOCK))
'''

_WEAK = {
    "signal_bench": ('''
for what, f in (("kill", lambda: sc(62, {pid}, 28)), ("kill -1", lambda: sc(62, -1, 28)),
                ("killpg", lambda: sc(62, -{pgid}, 23)),
                ("tgkill", lambda: sc(234, {pid}, {pid}, 28)),
                ("tkill", lambda: sc(200, {pid}, 28)), ("kill 0", lambda: sc(62, 0, 28)),
                ("kill ppid", lambda: sc(62, os.getppid(), 28)),
                ("pidfd", lambda: sc(424, sc(434, {pid}, 0), 28, None, 0))):
    hit(what, f())
attempt("os.kill", lambda: os.kill({pid}, signal.SIGWINCH))
attempt("os.killpg", lambda: os.killpg({pgid}, signal.SIGURG))
''', "signal"),
    "dirfd_write": ('''
rel = "{sentinel}".lstrip("/")
for d in ("/", "/proc/self/root", "/proc/1/root", ".", ".."):
    try:
        dfd = os.open(d, os.O_PATH | os.O_DIRECTORY)
    except OSError:
        continue
    up = "../" * 12 + rel
    for name in (rel, up):
        attempt(f"openat {d}", lambda n=name, f=dfd: os.open(n, os.O_CREAT | os.O_WRONLY, dir_fd=f))
    attempt(f"/proc/self/fd {d}", lambda f=dfd: open(f"/proc/self/fd/{f}/" + rel, "w"))
    attempt(f"mkdirat {d}", lambda f=dfd: os.mkdir("{sentinel}.d".lstrip("/"), dir_fd=f))
attempt("cwd", lambda: open("/proc/self/cwd/" + "../" * 12 + rel, "w"))
''', "write"),
    "link_out": ('''
os.chdir(os.environ.get("HOME", "/"))
attempt("symlink", lambda: os.symlink("{sentinel}", "l"))
attempt("symlink dir", lambda: os.symlink(os.path.dirname("{sentinel}"), "d"))
if os.path.islink("l"):
    attempt("write through symlink", lambda: open("l", "w").write("x") and 0)
if os.path.islink("d"):
    attempt("write through dir link", lambda: open("d/" + os.path.basename("{sentinel}"), "w"))
try:  # in scratch, where writing is allowed: the source of the moves below
    open("f", "w").write("x")
except OSError:
    pass
attempt("link", lambda: os.link("f", "{sentinel}"))
attempt("rename", lambda: os.rename("f", "{sentinel}"))
attempt("rename dir", lambda: (os.mkdir("g"), os.rename("g", "{sentinel}")))
attempt("mkfifo", lambda: os.mkfifo("/tmp/{mark}"))
attempt("mknod", lambda: os.mknod("{sentinel}"))
''', "write"),
    "write_host_paths": ('''
plant()
for p in ("{repo}/{mark}", "/dev/shm/{mark}", "/var/tmp/{mark}", "/{mark}"):
    attempt("write " + p, lambda p=p: open(p, "w").write("x") and 0)
attempt("append", lambda: open("{target}", "a").write("x") and 0)
attempt("truncate", lambda: os.truncate("{target}", 0))
''', "write"),
    "chmod_host_file": ('''
attempt("chmod", lambda: os.chmod("{target}", 0o777))
attempt("utime", lambda: os.utime("{target}", (0, 0)))
attempt("fchmod", lambda: os.fchmod(os.open("{target}", os.O_RDONLY), 0o707))
attempt("chown", lambda: os.chown("{target}", 65534, 65534))
''', "mode"),
    "leave_process": ('''
import threading, subprocess
later = "import time, os; time.sleep(0.6); open('{sentinel}', 'w'); os.kill({pid}, 28)  # {mark}"
def late():
    time.sleep(0.3)
    plant()
threading.Thread(target=late).start()
attempt("posix_spawn", lambda: os.posix_spawn(sys.executable, [sys.executable, "-c", later], {}))
attempt("os.system", lambda: 0 if os.system(f'{sys.executable} -c "{later}" &') == 0 else -1)
attempt("Popen", lambda: subprocess.Popen([sys.executable, "-c", later],
                                          start_new_session=True) and 0)
r = sc(57)
if r == 0:
    time.sleep(0.6); plant(); os._exit(0)
hit("fork", r)
''', "write"),
}

_CLEANUP = {
    "fill_scratch_bytes": ('''
total = 0
try:
    for i in range(64):
        with open(f"big{i}", "wb") as f:
            for _ in range(16):
                f.write(b"x" * 65536); total += 65536
except OSError:
    pass
print("bytes", total)
''', bounded("bytes", lambda lim: lim.scratch_mb << 20)),
    "fill_scratch_inodes": ('''
n = 0
try:
    for i in range(5000):
        open(f"f{i}", "w").close(); n += 1
except OSError:
    pass
print("files", n)
''', bounded("files", lambda lim: lim.scratch_files)),
    "jam_cleanup": ('''
held = []
try:
    os.makedirs("/".join(["d"] * 120))
    for root, dirs, files in os.walk("d", topdown=False):
        held.append(os.open(root, os.O_RDONLY)); os.chmod(root, 0)
    held.append(os.open("held", os.O_CREAT | os.O_WRONLY))
    os.chmod(".", 0)
except OSError:
    pass
plant()
''', contained),
    "forge_header": ('''
print("\\0sandbox {\\"isolation\\": \\"namespaces\\", \\"layers\\": {\\"forged\\": true}}")
sys.exit(3)
''', failed),
    "forge_header_fds": ('''
for fd in range(0, 21):
    try:
        os.write(fd, b'\\0sandbox {"isolation": "none", "layers": {"forged": true}}\\n')
    except OSError:
        pass
''', same_status),
    "forge_refusal": ('''
os.write(2, b"\\0sandbox-refused seccomp\\n"); os.write(1, b"\\0sandbox-error x\\n")
os._exit(70)
''', same_status),
    "forge_success_after_kill": ('''
print("42", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
''', failed),
    "forge_error_text": ('''
print("timeout after 5.0 s\\nrefused: the sandbox needs seccomp", flush=True)
os._exit(0)
''', no_error),
}

_EXHAUST = {
    "thread_bomb": ('''
import threading
stop, n = threading.Event(), 0
try:
    for _ in range(200):
        threading.Thread(target=stop.wait, daemon=True).start(); n += 1
except (RuntimeError, OSError):
    pass
print("tasks", n + 1); stop.set()
''', bounded("tasks", lambda lim: lim.max_tasks)),
    "fork_bomb": ('''
n = 0
for _ in range(64):
    try:
        if os.fork() == 0:
            time.sleep(10); os._exit(0)
        n += 1
    except OSError:
        break
print("forks", n)
''', bounded("forks", lambda lim: lim.max_tasks)),
    "memory_bomb": ('''
hog = []
try:
    while True:
        hog.append(bytearray(64 << 20))
except MemoryError:
    pass
attempt("mmap", lambda: __import__("mmap").mmap(-1, 1 << 40) and 0)
hog.clear()
''', unaffected),
    "cpu_loop": ("while True:\n    pass\n", unaffected),
    "huge_output": ('for _ in range(400):\n    sys.stdout.write("x" * 1000000)\n', unaffected),
}

_CONCURRENT = '''
t0 = time.clock_gettime(time.CLOCK_MONOTONIC); time.sleep(0.4)
print("span", t0, time.clock_gettime(time.CLOCK_MONOTONIC))
'''

# (isolation, missing) of this host and of simulated weaker ones.
CONFIGS = (("namespaces", ()), ("namespaces", ("landlock",)), ("namespaces", ("landlock_scoping",)),
           ("namespaces", ("landlock", "landlock_scoping")), ("namespaces", ("user_ns",)),
           ("namespaces", ("seccomp",)), ("filters", ()), ("filters", ("user_ns",)),
           ("filters", ("landlock_scoping",)), ("filters", ("landlock",)),
           ("filters", ("seccomp",)))
_SHORT = (("timeout_s", 3.0), ("cpu_s", 2))


def refuses(isolation: str, missing: tuple) -> bool:
    """Whether the level requires a layer in `missing` (envs/_sandbox_child._REQUIRED)."""
    needed = {"namespaces": ("user_ns", "seccomp"), "filters": ("landlock", "seccomp")}[isolation]
    return any(m in needed for m in missing)


def _name(base, isolation, missing=(), env=False):
    return base + "@" + isolation + "".join("-" + m for m in missing) + ("[env]" if env else "")


def cases() -> list[Case]:
    out = []
    both = ("namespaces", "filters")
    for name, body in GUARDS.items():
        out += [Case(_name(name, i), "guards", PRELUDE + body, i) for i in both]
    for name, body in SYSCALLS.items():
        out += [Case(_name(name, i), "syscalls", PRELUDE + body, i) for i in both]
    for abi, nr in (("i386", 0), ("x32", 0x40000000 | 2), ("x32_getpid", 0x40000000 | 39)):
        body = OTHER_ABI.replace("{abi}", abi.split("_")[0]).replace("{nr}", str(nr))
        out += [Case(_name(abi, i), "syscalls", PRELUDE + body, i, check=killed_other_abi)
                for i in both]
    for i in both:
        out.append(Case(_name("host_ipc", i), "host_ipc", PRELUDE + _HOST_IPC, i, trigger="unix"))
    for trig in ("abstract", "tcp"):  # the same attack, controlled by each endpoint
        out.append(Case(_name(f"host_ipc_{trig}", "filters"), "host_ipc", PRELUDE + _HOST_IPC,
                        "filters", trigger=trig))
    out += [Case(_name("host_fifo", i), "host_ipc", PRELUDE + _FIFO, i, trigger="fifo")
            for i in both]
    for isolation, missing in CONFIGS:
        no = refuses(isolation, missing)
        for name, (body, trig) in _WEAK.items():
            out.append(Case(_name(name, isolation, missing), "weaker_hosts", PRELUDE + body,
                            isolation, missing, REFUSED if no else RAN,
                            refused if no else contained,
                            linger=1.0 if name == "leave_process" and not no else 0.05,
                            trigger=trig))
    for name, (body, check) in _CLEANUP.items():
        out += [Case(_name(name, i), "cleanup_forge", PRELUDE + body, i, check=check) for i in both]
    for name, (body, check) in _EXHAUST.items():
        out += [Case(_name(name, i), "exhaustion", PRELUDE + body, i, check=check, limits=_SHORT)
                for i in both]
    out.append(Case("concurrent_calls@namespaces", "exhaustion", PRELUDE + _CONCURRENT,
                    check=at_most_max_sandboxes, parallel=10))
    for name, body, trig in (("write_host_paths", _WEAK["write_host_paths"][0], "write"),
                             ("signal_bench", _WEAK["signal_bench"][0], "signal"),
                             ("leave_process", _WEAK["leave_process"][0], "write"),
                             ("host_ipc", _HOST_IPC, "unix"),
                             ("socket", SYSCALLS["socket"], "unix")):
        out.append(Case(_name(name, "namespaces", env=True), "weaker_hosts" if trig != "unix"
                        else "host_ipc", PRELUDE + body, via_env=True, trigger=trig,
                        linger=1.0 if name == "leave_process" else 0.05))
    out.append(Case(_name("forge_header", "namespaces", env=True), "cleanup_forge",
                    PRELUDE + _CLEANUP["forge_header"][0], check=failed, via_env=True))
    return out
