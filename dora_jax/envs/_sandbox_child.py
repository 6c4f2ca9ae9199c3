"""The sandbox's bootstrap: isolates a process, then runs untrusted code in it.

Run as ``python -I -S -B _sandbox_child.py`` with the request (JSON: code, limits,
isolation level) on stdin. Nothing of ``dora_jax`` is imported; the filters module
is loaded by path. Two processes:

- the launcher (this process) reads the request, makes the namespaces and, when it
  is root, maps the child's root to an unprivileged host uid; it waits for the child
  and exits as the child did (a signal is re-raised on itself);
- the child, pid 1 of a new pid namespace (every process it could start dies with
  it), builds a minimal root (the interpreter's stdlib and shared libraries read-only,
  /dev/null, /dev/zero, /dev/urandom, a size-capped tmpfs at /scratch) on a tmpfs,
  pivots into it and forks the process that runs the code (pid 2: pid 1 only
  waits), which drops capabilities, sets rlimits and no_new_privs, loads Landlock
  and the seccomp allow-list, closes every descriptor but 0-2, reports the layers it
  runs under as the first line of its output, and only then runs the code.

A layer the isolation level requires and the host lacks stops the bootstrap before
any code runs (a ``\\0sandbox-refused`` line). The report line is written before the
code runs, so the code cannot forge it; everything after it is the code's output.
"""

import ctypes
import json
import os
import platform
import resource
import signal
import sys

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                        ctypes.c_ulong, ctypes.c_char_p]
_SYSCALLS = {"x86_64": {"pivot_root": 155, "capset": 126},
             "aarch64": {"pivot_root": 41, "capset": 91}}.get(platform.machine(), {})
_NEWNS, _NEWUTS, _NEWIPC, _NEWUSER, _NEWPID, _NEWNET = (
    0x00020000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
_RDONLY, _NOSUID, _NODEV, _REMOUNT, _BIND, _REC, _PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
_OUTER_ID = 65534  # the host uid/gid the child's root maps to when the launcher is root
_DEVICES = ("null", "zero", "urandom")
_REQUIRED = {
    "namespaces": ("user_ns", "pid_ns", "mount_ns", "net_ns", "ipc_ns", "capabilities",
                   "no_new_privs", "rlimits", "seccomp"),
    "filters": ("capabilities", "no_new_privs", "rlimits", "seccomp", "landlock"),
}


class SetupError(Exception):
    pass


def _check(ok, what):
    if not ok:
        raise SetupError(f"{what}: {os.strerror(ctypes.get_errno())}")


def _mount(source, target, fstype, flags, data=None):
    def enc(s):
        return s.encode() if isinstance(s, str) else s

    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) == 0,
           f"mount {target}")


def _unshare(flags, what):
    _check(_libc.unshare(flags) == 0, f"unshare {what}")


def _write_ids(pid, uid, gid):
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"),
                       ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(text)


# ------------------------------------------------------------------ the minimal root

def _host_paths():
    """What the interpreter needs: its stdlib directories and every directory a
    shared library it has mapped lives in (the rest of a C extension's libraries sit
    beside libc), plus the loader's cache."""
    paths = {os.path.realpath(p) for p in sys.path if p and os.path.exists(p)}
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/") and ".so" in parts[5]:
                paths.add(os.path.dirname(os.path.realpath(parts[5].strip())))
    if os.path.isfile("/etc/ld.so.cache"):
        paths.add("/etc/ld.so.cache")
    kept: list[str] = []
    for p in sorted(paths, key=len):
        if not any(p == k or p.startswith(k + os.sep) for k in kept):
            kept.append(p)
    return kept


def _site_packages(exposed):
    import sysconfig  # noqa: PLC0415 - only the bootstrap needs it

    found = set()
    for key in ("purelib", "platlib"):
        path = os.path.realpath(sysconfig.get_paths()[key])
        if os.path.isdir(path) and any(path.startswith(e + os.sep) for e in exposed):
            found.add(path)
    return sorted(found)


def _bind(source, target, flags):
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(source, target, None, _BIND)
    _mount(None, target, None, _REMOUNT | _BIND | flags)


def _build_root(limits, as_root):
    """Mounts the minimal root on a fresh tmpfs and pivots into it."""
    _mount(None, "/", None, _REC | _PRIVATE)  # nothing propagates back to the host
    base = next(d for d in ("/tmp", "/mnt", "/run", "/var/tmp", "/") if os.path.isdir(d))
    new = os.path.join(base, ".dora-sandbox-root") if base == "/" else base
    _mount("tmpfs", new, "tmpfs", _NOSUID | _NODEV, "size=1m,nr_inodes=2048,mode=0755")
    exposed = _host_paths()
    # Symlinked top-level directories (merged /usr: /lib -> usr/lib) as on the host,
    # so library paths the loader cache names still resolve.
    for entry in os.listdir("/"):
        if os.path.islink("/" + entry):
            os.symlink(os.readlink("/" + entry), os.path.join(new, entry))
    for path in exposed:
        _bind(path, new + path, _RDONLY | _NOSUID | _NODEV)
    for path in _site_packages(exposed):  # installed packages are not the stdlib
        _mount("tmpfs", new + path, "tmpfs", _RDONLY | _NOSUID | _NODEV, "size=4k,mode=0555")
    for name in _DEVICES:
        _bind(f"/dev/{name}", f"{new}/dev/{name}", _NOSUID)
    owner = f",uid={_OUTER_ID},gid={_OUTER_ID}" if as_root else ""
    os.mkdir(new + "/scratch")
    _mount("tmpfs", new + "/scratch", "tmpfs", _NOSUID | _NODEV,
           f"size={limits['scratch_kb']}k,nr_inodes={limits['scratch_files']},mode=0700{owner}")
    os.mkdir(new + "/.old")
    _check(_libc.syscall(_SYSCALLS["pivot_root"], new.encode(), (new + "/.old").encode()) == 0,
           "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old", 2) == 0, "umount old root")  # MNT_DETACH
    os.rmdir("/.old")
    _mount(None, "/", None, _REMOUNT | _RDONLY | _NOSUID | _NODEV)


# ------------------------------------------------------------------ the child

def _drop_capabilities():
    for cap in range(64):
        _libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP; EINVAL past the last cap
    _libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    return _libc.syscall(_SYSCALLS.get("capset", -1), header, data) == 0


def _rlimits(limits, tasks):
    mb = 1 << 20
    for what, soft, hard in (
            (resource.RLIMIT_AS, limits["memory_mb"] * mb, limits["memory_mb"] * mb),
            # Hard one second above soft: SIGXCPU first, which the parent names.
            (resource.RLIMIT_CPU, limits["cpu_s"], limits["cpu_s"] + 1),
            (resource.RLIMIT_FSIZE, limits["fsize_mb"] * mb, limits["fsize_mb"] * mb),
            (resource.RLIMIT_NOFILE, 64, 64),
            (resource.RLIMIT_CORE, 0, 0),
            (resource.RLIMIT_NPROC, tasks, tasks)):
        resource.setrlimit(what, (soft, hard))
    return True


def _child(request, as_root, sync):
    level, limits, missing = request["isolation"], request["limits"], set(request["missing"])
    layers: dict = {}
    filters = _load_filters(request["filters"])  # before the pivot hides its file
    _libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: dies with the launcher
    spaced = level == "namespaces" and "user_ns" in request["made"]
    if spaced:
        if as_root:  # namespaces owned by the host: the child gets no power over them
            _unshare(_NEWNS | _NEWNET | _NEWIPC | _NEWUTS, "mount/net/ipc/uts")
        _build_root(limits, as_root)
        if as_root:
            _unshare(_NEWUSER, "user")
            os.write(sync[1], b"u")
            _check(os.read(sync[2], 1) == b"m", "uid map")
            # Until now the credentials were still the host's root, merely unmapped
            # here: become the mapped uid, an unprivileged one on the host.
            os.setresgid(0, 0, 0)
            os.setresuid(0, 0, 0)
        layers.update(user_ns=True, pid_ns=True, mount_ns=True, net_ns=True, ipc_ns=True)
        fd = os.open("/dev/null", os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)
        os.chdir("/scratch")
        os.environ.update(HOME="/scratch", TMPDIR="/scratch")
    _split_from_init(sync[3])
    layers["capabilities"] = _drop_capabilities()
    # RLIMIT_NPROC counts the uid's tasks in the user namespace: pid 1 (and an
    # unprivileged launcher) are among them.
    tasks = limits["max_tasks"] + (1 if as_root else 2)
    layers["rlimits"] = _rlimits(limits, tasks if spaced else 1)
    layers["no_new_privs"] = _libc.prctl(38, 1, 0, 0, 0) == 0
    # Without the minimal root: reads only of what the interpreter needs, no writes.
    paths = (["/"], ["/scratch"], [f"/dev/{d}" for d in _DEVICES]) if spaced else (
        _host_paths(), [], ["/dev/null"])
    abi, scoped = (0, False) if "landlock" in missing else filters.load_landlock(
        *paths, 5 if "landlock_scoping" in missing else 99)
    layers["landlock"], layers["landlock_abi"], layers["landlock_scoping"] = abi > 0, abi, scoped
    # Threads only where the pid namespace's task limit counts them.
    layers["seccomp"] = "seccomp" not in missing and filters.load_seccomp(threads=spaced)
    absent = [name for name in _REQUIRED[level] if not layers.get(name)]
    os.closerange(3, 1 << 16)
    if absent:
        os.write(2, f"\0sandbox-refused {absent[0]}\n".encode())
        os._exit(70)
    os.write(1, b"\0sandbox " + json.dumps({"isolation": level, "layers": layers}).encode() + b"\n")
    _run(request["code"])


def _split_from_init(status_w):
    """Forks the process that runs the code: pid 1 of a namespace ignores signals it
    has no handler for (the CPU limit's SIGXCPU among them), so the code runs as pid
    2 while pid 1 only waits for it and hands its wait status to the launcher. When
    pid 1 exits the kernel kills whatever else is left in the namespace."""
    pid = os.fork()
    if pid == 0:
        return
    _, status = os.waitpid(pid, 0)
    os.write(status_w, status.to_bytes(4, "little"))
    os._exit(0)


def _load_filters(path):
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.spec_from_file_location("_sandbox_filters", path)
    assert spec is not None and spec.loader is not None  # a .py path always has both
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(code):
    status = 0
    try:
        exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:  # noqa: BLE001 - shown to the model as a terminal would
        import traceback  # noqa: PLC0415

        try:
            sys.stdout.flush()
        except BaseException:  # noqa: BLE001
            pass
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None
        traceback.print_exception(type(exc), exc, tb, limit=-5)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass
    os._exit(status & 0xFF)


# ------------------------------------------------------------------ the launcher

def _make_namespaces(request, as_root):
    """The namespaces made before the child's fork; returns their names."""
    if request["isolation"] != "namespaces" or "user_ns" in request["missing"]:
        return []
    if as_root:
        _unshare(_NEWPID, "pid")
        return ["user_ns"]  # the child makes the rest itself, then its user namespace
    uid, gid = os.geteuid(), os.getegid()
    _unshare(_NEWUSER, "user")
    _write_ids("self", uid, gid)
    _unshare(_NEWPID | _NEWNS | _NEWNET | _NEWIPC | _NEWUTS, "pid/mount/net/ipc/uts")
    return ["user_ns"]


def _relay(status):
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 71)


def main():
    request = json.loads(sys.stdin.buffer.read(1 << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    as_root = os.geteuid() == 0
    try:
        request["made"] = _make_namespaces(request, as_root)
    except (SetupError, OSError):
        request["made"] = []
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    status_r, status_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _child(request, as_root, (ready_r, ready_w, go_r, status_w))
        except (SetupError, OSError) as exc:
            os.write(2, f"\0sandbox-error {exc}\n".encode())
            os._exit(70)
    os.close(ready_w)
    if as_root and request["made"]:
        if os.read(ready_r, 1) == b"u":
            _write_ids(pid, _OUTER_ID, _OUTER_ID)
            os.write(go_w, b"m")
    os.close(ready_r)
    os.close(go_w)
    os.close(status_w)
    _, status = os.waitpid(pid, 0)
    code_status = os.read(status_r, 4)  # the code's own status, from pid 1
    _relay(int.from_bytes(code_status, "little") if len(code_status) == 4 else status)


if __name__ == "__main__":
    main()
