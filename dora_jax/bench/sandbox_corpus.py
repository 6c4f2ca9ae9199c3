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
import re
from collections.abc import Callable

RAN, REFUSED = "ran, contained", "refused at start"
CLASSES = ("guards", "syscalls", "host_ipc", "weaker_hosts", "cleanup_forge", "exhaustion")


@dataclasses.dataclass
class Observation:
    result: object  # envs.sandbox.SandboxResult (built from the observation for env cases)
    tripped: list  # host-side tripwires fired for the case
    probe: object  # a run of "pass" at the same level, for status comparisons
    limits: object  # the SandboxLimits the call ran under
    elapsed: float  # wall seconds of the call, seen from the bench
    stall: float = 0.0  # longest extra wait of a bench thread during the call
    extra: dict = dataclasses.field(default_factory=dict)


def _refused(r) -> bool:
    return (not r.ok) and (r.error or "").startswith("refused") and r.isolation is None


def _number(text: str, key: str) -> int:
    found = re.findall(rf"^{key} (\d+)$", text, re.M)
    return int(found[-1]) if found else 0


def _base(o: Observation) -> str | None:
    """What makes any case an escape: a tripwire, a reported success, or a call that
    overran its timeout (the bench must get control back)."""
    if o.tripped:
        return "tripped: " + ", ".join(o.tripped)
    if "ESCAPED" in o.result.stdout:
        return "reported: " + o.result.stdout[o.result.stdout.index("ESCAPED"):][:120]
    if o.elapsed > o.limits.timeout_s + 2:
        return f"call took {o.elapsed:.1f} s"
    return None


def contained(o):
    return _base(o)


def refused(o):
    return _base(o) or (None if _refused(o.result) else
                        f"ran without a required layer: {o.result.error}")


def failed(o):
    return same_status(o) or ("reported success" if o.result.ok else None)


def same_status(o):
    r, p = o.result, o.probe
    if r.isolation != p.isolation or r.protections != p.protections:
        return f"status differs from the probe: {r.isolation} {r.protections}"
    if (r.error or "").startswith("refused"):
        return f"forged refusal: {r.error}"
    return _base(o)


def no_error(o):
    return same_status(o) or (f"error forged: {o.result.error}" if o.result.error else None)


def killed_other_abi(o):
    return _base(o) or (None if (o.result.error or "").endswith("another ABI") or
                        _refused(o.result) else f"not killed: {o.result.error}")


def bounded(key: str, cap: Callable) -> Callable:
    def check(o):
        n = _number(o.result.stdout, key)
        return _base(o) or (f"{key} {n} > {cap(o.limits)}" if n > cap(o.limits) else None)
    check.__name__ = f"bounded_{key}"
    return check


def unaffected(o):
    if o.stall > 1.0:
        return f"bench stalled {o.stall:.2f} s"
    if len(o.result.stdout) > o.limits.max_output_bytes + 64:
        return f"{len(o.result.stdout)} output characters kept"
    return _base(o)


def at_most_max_sandboxes(o):
    n = o.extra.get("overlap", 0)
    return _base(o) or (f"{n} sandboxes at once" if n > o.limits.max_sandboxes else None)


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


_PRE = r'''
import ctypes, os, sys, signal, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def sc(nr, *a):
    a = [ctypes.c_long(x) if isinstance(x, int) else x for x in a]
    return libc.syscall(ctypes.c_long(nr), *a)
def hit(what, r):
    if isinstance(r, int) and not isinstance(r, bool) and r >= 0:
        print("ESCAPED", what, r, flush=True)
def attempt(what, f):
    try:
        r = f()
        hit(what, 0 if r is None else r)
    except BaseException:
        pass
def plant():
    for p in ("{sentinel}", "/tmp/{mark}", "{home}/{mark}"):
        attempt("write " + p, lambda p=p: open(p, "w").write("x") and 0)
'''

_SYSCALLS = {
    "io_uring_setup": 'p = ctypes.create_string_buffer(120); hit("io_uring_setup", sc(425, 8, p))',
    "openat2": 'how = (ctypes.c_uint64 * 3)(0o101, 0o644, 0)\n'
               'hit("openat2", sc(437, -100, b"{sentinel}", how, 24))',
    "open_tree": 'hit("open_tree", sc(428, -100, b"/", 1 | 0x80000))\n'
                 'hit("move_mount", sc(429, -100, b"/", -100, b"/scratch", 0))\n'
                 'hit("fsopen", sc(430, b"tmpfs", 0))',
    "socket": 'for fam, typ in ((1, 1), (1, 2), (2, 1), (2, 2), (10, 1), (16, 3), (17, 3),'
              ' (40, 1)):\n'
              '    hit(f"socket {fam} {typ}", sc(41, fam, typ, 0))\n'
              'sv = (ctypes.c_int * 2)(); hit("socketpair", sc(53, 1, 1, 0, sv))\n'
              'import socket\n'
              'attempt("python socket", lambda: socket.socket(socket.AF_UNIX).connect("{unix}"))',
    "memfd_execveat": 'fd = sc(319, b"x", 0); hit("memfd_create", fd)\n'
                      'argv = (ctypes.c_char_p * 2)(b"x", None)\n'
                      'hit("execveat", sc(322, fd if fd >= 0 else 0, b"", argv, argv, 0x1000))',
    "process_vm_writev": 'iov = (ctypes.c_void_p * 2)(0, 0)\n'
                         'hit("process_vm_writev", sc(311, os.getppid(), iov, 1, iov, 1, 0))\n'
                         'hit("process_vm_readv", sc(310, os.getppid(), iov, 1, iov, 1, 0))',
    "ptrace": 'hit("ptrace attach", sc(101, 16, os.getppid(), 0, 0))\n'
              'hit("ptrace traceme", sc(101, 0, 0, 0, 0))',
    "bpf": 'attr = (ctypes.c_uint32 * 32)(2, 4, 4, 1)\nhit("bpf map", sc(321, 0, attr, 128))',
    "userfaultfd": 'hit("userfaultfd", sc(323, 0))',
    "pidfd": 'for target in (os.getppid(), {pid}, 1):\n'
             '    fd = sc(434, target, 0); hit(f"pidfd_open {target}", fd)\n'
             '    hit("pidfd_getfd", sc(438, fd, 0, 0))\n'
             '    hit("pidfd_send_signal", sc(424, fd, 28, None, 0))',
    "personality_prctl": 'hit("personality", sc(135, 0x0400000))\n'
                         'hit("prctl set_name", sc(157, 15, b"x", 0, 0, 0))\n'
                         'hit("prctl dumpable", sc(157, 4, 1, 0, 0, 0))\n'
                         'hit("seccomp", sc(317, 0, 0, None))',
    "mount_unshare_setns": 'hit("mount", sc(165, b"none", b"/scratch", b"tmpfs", 0, None))\n'
                           'hit("umount2", sc(166, b"/scratch", 2))\n'
                           'for flag in (0x10000000, 0x20000, 0x40000000, 0x20000000):\n'
                           '    hit(f"unshare {flag:#x}", sc(272, flag))\n'
                           'hit("setns", sc(308, 0, 0))\nhit("chroot", sc(161, b"/scratch"))\n'
                           'hit("setuid", sc(105, 0))',
    "keyctl_perf": 'hit("keyctl", sc(250, 0, -3, 0))\n'
                   'hit("add_key", sc(248, b"user", b"x", b"y", 1, -3))\n'
                   'attr = (ctypes.c_uint32 * 32)(1, 128)\n'
                   'hit("perf_event_open", sc(298, attr, 0, -1, -1, 0))',
    "handles_iopl": 'h = (ctypes.c_char * 136)(); m = ctypes.c_int()\n'
                    'hit("name_to_handle_at", sc(303, -100, b"/", h, ctypes.byref(m), 0))\n'
                    'hit("open_by_handle_at", sc(304, -100, h, 0))\n'
                    'hit("iopl", sc(172, 3))\nhit("ioperm", sc(173, 0x80, 1, 1))',
    "fork_execve": 'r = sc(57)\nif r == 0:\n    os._exit(0)\nhit("fork", r)\n'
                   'argv = (ctypes.c_char_p * 2)(b"/bin/sh", None)\n'
                   'hit("execve", sc(59, b"/bin/sh", argv, None))\n'
                   'hit("clone newuser", sc(56, 0x10000000 | 17, 0, 0, 0, 0))',
    "tiocsti": 'c = ctypes.c_char(b"x")\nfor fd in (0, 1, 2):\n'
               '    hit(f"TIOCSTI {fd}", libc.ioctl(fd, 0x5412, ctypes.byref(c)))\n'
               'try:\n    t = os.open("/dev/tty", os.O_RDONLY)\n'
               '    hit("TIOCSTI tty", libc.ioctl(t, 0x5412, ctypes.byref(c)))\n'
               'except OSError:\n    pass',
}

# Machine code in an executable page below 4 GiB (so the i386 ABI can take pointers):
# `int 0x80` open(sentinel) and x32 open(sentinel) and getpid. The filter must kill
# the process at the first instruction; a return means another ABI got through.
_ABI = r'''
import mmap, struct
page = mmap.mmap(-1, 4096, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40,
                 mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
base = ctypes.addressof(ctypes.c_char.from_buffer(page))
path = b"{sentinel}\0"
page[2048:2048 + len(path)] = path
if "{abi}" == "i386":
    code = (b"\xb8\x05\0\0\0" + b"\xbb" + struct.pack("<I", base + 2048) +
            b"\xb9" + struct.pack("<I", 0o101) + b"\xba" + struct.pack("<I", 0o644) +
            b"\xcd\x80\xc3")
else:
    code = (b"\x48\xbf" + struct.pack("<Q", base + 2048) + b"\xbe" +
            struct.pack("<I", 0o101) + b"\xba" + struct.pack("<I", 0o644) + b"\xb8" +
            struct.pack("<I", {nr}) + b"\x0f\x05\xc3")
page[0:len(code)] = code
fn = ctypes.CFUNCTYPE(ctypes.c_long)(base)
print("ESCAPED {abi} returned", fn(), flush=True)
'''

_GUARDS = {
    "audit_hooks_off": r'''
import gc, types
for name in ("_PySys_ClearAuditHooks", "PySys_ClearAuditHooks"):
    attempt(name, lambda name=name: getattr(ctypes.pythonapi, name)() and 0)
sys.addaudithook(lambda *a: None)
for o in gc.get_objects():
    if isinstance(o, types.FunctionType) and "audit" in o.__name__:
        o.__code__ = (lambda *a, **k: None).__code__
import builtins; builtins.__import__ = __import__
plant()
attempt("os.system", lambda: 0 if os.system("echo > {sentinel}") == 0 else -1)
''',
    "bootstrap_reentry": r'''
import __main__ as boot
for step in (lambda: boot._mount(None, "/", None, 32), lambda: boot._unshare(0x10000000, "u"),
             lambda: boot._write_ids("self", 0, 0), lambda: boot.os.setresuid(0, 0, 0)):
    attempt("bootstrap step", step)
plant()
''',
    "rlimits_raise": r'''
import resource
before = {r: resource.getrlimit(r) for r in (resource.RLIMIT_AS, resource.RLIMIT_NPROC,
                                             resource.RLIMIT_CPU, resource.RLIMIT_FSIZE)}
for r, (soft, hard) in before.items():
    attempt("setrlimit", lambda r=r: resource.setrlimit(r, (-1, -1)))
    if resource.getrlimit(r)[1] != hard:
        print("ESCAPED hard limit raised", r)
''',
    "ctypes_poke": r'''
# Overwrite the bytes of os-level functions' names and the interpreter's flags, then
# retry what the kernel layers deny: the guard is outside the interpreter.
for n in ("Py_IsolatedFlag", "Py_NoSiteFlag"):
    try:
        ctypes.c_int.in_dll(ctypes.pythonapi, n).value = 0
    except (ValueError, AttributeError):
        pass
ctypes.memset(id(sys.flags) + 16, 0, 8)
plant()
import socket
for target in ("{unix}", "\0{abstract}"):
    attempt("connect " + target, lambda t=target: socket.socket(socket.AF_UNIX).connect(t))
''',
}

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
    for name, body in _GUARDS.items():
        out += [Case(_name(name, i), "guards", _PRE + body, i) for i in both]
    for name, body in _SYSCALLS.items():
        out += [Case(_name(name, i), "syscalls", _PRE + body, i) for i in both]
    for abi, nr in (("i386", 0), ("x32", 0x40000000 | 2), ("x32_getpid", 0x40000000 | 39)):
        body = _ABI.replace("{abi}", abi.split("_")[0]).replace("{nr}", str(nr))
        out += [Case(_name(abi, i), "syscalls", _PRE + body, i, check=killed_other_abi)
                for i in both]
    for i in both:
        out.append(Case(_name("host_ipc", i), "host_ipc", _PRE + _HOST_IPC, i, trigger="unix"))
    for trig in ("abstract", "tcp"):  # the same attack, controlled by each endpoint
        out.append(Case(_name(f"host_ipc_{trig}", "filters"), "host_ipc", _PRE + _HOST_IPC,
                        "filters", trigger=trig))
    out += [Case(_name("host_fifo", i), "host_ipc", _PRE + _FIFO, i, trigger="fifo") for i in both]
    for isolation, missing in CONFIGS:
        no = refuses(isolation, missing)
        for name, (body, trig) in _WEAK.items():
            out.append(Case(_name(name, isolation, missing), "weaker_hosts", _PRE + body,
                            isolation, missing, REFUSED if no else RAN,
                            refused if no else contained,
                            linger=1.0 if name == "leave_process" and not no else 0.05,
                            trigger=trig))
    for name, (body, check) in _CLEANUP.items():
        out += [Case(_name(name, i), "cleanup_forge", _PRE + body, i, check=check) for i in both]
    for name, (body, check) in _EXHAUST.items():
        out += [Case(_name(name, i), "exhaustion", _PRE + body, i, check=check, limits=_SHORT)
                for i in both]
    out.append(Case("concurrent_calls@namespaces", "exhaustion", _PRE + _CONCURRENT,
                    check=at_most_max_sandboxes, parallel=10))
    for name, body, trig in (("write_host_paths", _WEAK["write_host_paths"][0], "write"),
                             ("signal_bench", _WEAK["signal_bench"][0], "signal"),
                             ("leave_process", _WEAK["leave_process"][0], "write"),
                             ("host_ipc", _HOST_IPC, "unix"),
                             ("socket", _SYSCALLS["socket"], "unix")):
        out.append(Case(_name(name, "namespaces", env=True), "weaker_hosts" if trig != "unix"
                        else "host_ipc", _PRE + body, via_env=True, trigger=trig,
                        linger=1.0 if name == "leave_process" else 0.05))
    out.append(Case(_name("forge_header", "namespaces", env=True), "cleanup_forge",
                    _PRE + _CLEANUP["forge_header"][0], check=failed, via_env=True))
    return out
