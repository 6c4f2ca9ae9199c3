"""Child-side bootstrap of the sandbox: restricts this process, then runs untrusted code.

Run as ``python -I -S _sandbox_child.py <status_fd> <limits_json> <code>`` with the
scratch directory as cwd.  Nothing from ``dora_jax`` is imported: the child must not
depend on the parent's environment.  Every kernel layer is optional; the ones that
were applied are reported on the status fd as a JSON line before the code runs, and
the outcome (``{"error": ...}``) as a JSON line after.
"""

import ctypes
import json
import os
import resource
import sys

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.restype = ctypes.c_int

_PR_SET_NO_NEW_PRIVS = 38
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_CLONE_THREAD = 0x00010000
_SYS_CAPSET = 126  # x86_64
_SYS_LANDLOCK_CREATE_RULESET = 444
_SYS_LANDLOCK_ADD_RULE = 445
_SYS_LANDLOCK_RESTRICT_SELF = 446


def _apply_rlimits(limits):
    mb = 1024 * 1024
    pairs = [
        (resource.RLIMIT_AS, limits["memory_mb"] * mb),
        # The hard limit sits one second above the soft one so SIGXCPU (a clear,
        # catchable-by-parent signal) arrives before the SIGKILL.
        (resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1)),
        (resource.RLIMIT_FSIZE, limits["fsize_mb"] * mb),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_CORE, 0),
    ]
    for what, value in pairs:
        soft, hard = value if isinstance(value, tuple) else (value, value)
        resource.setrlimit(what, (soft, hard))
    return True


def _new_netns():
    """An empty network namespace: only a down loopback, so nothing is reachable."""
    if _libc.unshare(_CLONE_NEWNET) == 0:
        return True
    # Unprivileged hosts: a user namespace grants CAP_SYS_ADMIN over the new netns.
    return _libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) == 0


def _drop_capabilities():
    """Empty the capability sets; when run as root this removes the root powers
    (mount, module loading, DAC override...) that no filter below would catch."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    header = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (Data * 2)()
    return _libc.syscall(_SYS_CAPSET, ctypes.byref(header), ctypes.byref(data)) == 0


def _landlock(scratch):
    """Writes only beneath ``scratch``; no TCP bind/connect; no signals or abstract
    unix sockets reaching outside this process's domain.  Reads stay allowed."""
    abi = _libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, None, 0, 1)
    if abi < 1:
        return False
    write_fs = 0
    for bit in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12):  # WRITE_FILE, REMOVE_*, MAKE_*
        write_fs |= 1 << bit
    if abi >= 2:
        write_fs |= 1 << 13  # REFER
    if abi >= 3:
        write_fs |= 1 << 14  # TRUNCATE
    if abi >= 5:
        write_fs |= 1 << 15  # IOCTL_DEV
    net = 0b11 if abi >= 4 else 0  # BIND_TCP | CONNECT_TCP, with no rule allowing any
    scoped = 0b11 if abi >= 6 else 0  # ABSTRACT_UNIX_SOCKET | SIGNAL

    class RulesetAttr(ctypes.Structure):
        _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64),
                    ("scoped", ctypes.c_uint64)]

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    attr = RulesetAttr(write_fs, net, scoped)
    size = 8 if abi < 4 else (16 if abi < 6 else 24)
    ruleset = _libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        return False
    try:
        dir_fd = os.open(scratch, os.O_PATH | os.O_DIRECTORY)
        try:
            rule = PathBeneath(write_fs, dir_fd)
            if _libc.syscall(_SYS_LANDLOCK_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0):
                return False
        finally:
            os.close(dir_fd)
        if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
            return False
        return _libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) == 0
    finally:
        os.close(ruleset)


def _seccomp():
    """Refuse process creation, sockets, signals to others and admin syscalls."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        return False

    class ArgCmp(ctypes.Structure):
        _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                    ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]

    cmp_ne, cmp_masked_eq = 1, 7
    allow = 0x7FFF0000

    def errno(code):
        return 0x00050000 | code

    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.c_void_p]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(allow)
    if not ctx:
        return False
    eperm, enosys = 1, 38
    rules = [(name, eperm, []) for name in (
        "fork", "vfork", "execve", "execveat", "socket", "ptrace", "process_vm_writev",
        "process_vm_readv", "mount", "umount2", "pivot_root", "chroot", "unshare",
        "setns", "bpf", "perf_event_open", "init_module", "finit_module",
        "delete_module", "kexec_load", "reboot", "swapon", "keyctl", "add_key")]
    # clone without CLONE_THREAD makes a process; with it a thread, which is fine.
    rules.append(("clone", eperm, [ArgCmp(0, cmp_masked_eq, _CLONE_THREAD, 0)]))
    # clone3 passes its flags in memory a filter cannot read: ENOSYS makes libc
    # fall back to clone, which the rule above can inspect.
    rules.append(("clone3", enosys, []))
    pid = os.getpid()
    rules.append(("kill", eperm, [ArgCmp(0, cmp_ne, pid, 0)]))
    rules.append(("tgkill", eperm, [ArgCmp(0, cmp_ne, pid, 0)]))
    try:
        for name, code, args in rules:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                continue
            array = (ArgCmp * max(len(args), 1))(*args)
            if lib.seccomp_rule_add_array(ctx, errno(code), nr, len(args), array):
                return False
        return lib.seccomp_load(ctx) == 0
    finally:
        lib.seccomp_release(ctx)


def _fallback_no_fork():
    # RLIMIT_NPROC counts every process of the user, so 0 here stops this process
    # from forking without touching anyone else; it also stops threads, which is
    # why it is only used when seccomp could not be loaded.
    try:
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
        return os.getuid() != 0  # root ignores RLIMIT_NPROC
    except (ValueError, OSError):
        return False


class Refused(PermissionError):
    """Raised by the audit hook; the message starts with "refused: "."""


def _install_audit_hook(scratch):
    real_scratch = os.path.realpath(scratch)
    process_events = ("subprocess.Popen", "os.system", "os.fork", "os.forkpty",
                      "os.exec", "os.spawn", "os.posix_spawn", "pty.spawn", "os.kill",
                      "os.killpg")
    path_events = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink",
                   "os.link", "os.chmod", "os.chown", "os.truncate", "os.utime",
                   "shutil.rmtree")
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    # Bound once, so code that rebinds os.path functions cannot steer the checks.
    realpath, isabs, join = os.path.realpath, os.path.isabs, os.path.join
    startswith, fspath, getcwd = str.startswith, os.fspath, os.getcwd

    def inside(path):
        if isinstance(path, int):
            return True  # an already-open fd: the open itself was checked
        path = fspath(path)
        if isinstance(path, bytes):
            path = path.decode(errors="surrogateescape")
        full = realpath(path if isabs(path) else join(getcwd(), path))
        return full == real_scratch or startswith(full, real_scratch + os.sep)

    def hook(event, args):
        if event.startswith("socket."):
            raise Refused("refused: socket")
        if event.startswith("ctypes."):
            raise Refused("refused: ctypes")
        if event.startswith(process_events):
            raise Refused("refused: process creation")
        if event == "open":
            path, mode, flags = args
            writing = (mode is not None and any(c in mode for c in "wax+")) or (
                mode is None and isinstance(flags, int) and flags & write_flags)
            if writing and not inside(path):
                raise Refused(f"refused: write outside scratch: {path!r}")
        elif event.startswith(path_events):
            for path in args:
                if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                    raise Refused(f"refused: write outside scratch: {path!r}")

    sys.addaudithook(hook)
    return True


def _one_line(exc):
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, Refused):
        text = str(exc)
    return text.splitlines()[0][:300] if text else type(exc).__name__


def main():
    status = os.fdopen(int(sys.argv[1]), "w", buffering=1)
    limits = json.loads(sys.argv[2])
    code = sys.argv[3]
    del sys.argv[1:3]
    scratch = os.getcwd()
    layers = {"rlimits": _apply_rlimits(limits), "netns": _new_netns()}
    layers["capabilities_dropped"] = _drop_capabilities() if os.getuid() == 0 else True
    layers["landlock"] = _landlock(scratch)
    layers["seccomp"] = _seccomp()
    if not layers["seccomp"]:
        layers["nproc_limit"] = _fallback_no_fork()
    layers["audit_hook"] = limits["audit_hook"] and _install_audit_hook(scratch)
    status.write(json.dumps({"layers": layers}) + "\n")
    error = None
    try:
        exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        if exc.code not in (None, 0):
            error = f"SystemExit: {exc.code}"[:300]
    except BaseException as exc:  # noqa: BLE001 - every failure of the code is reported
        error = _one_line(exc)
        import traceback
        try:  # what the code printed comes before its traceback, as on a terminal
            sys.stdout.flush()
        except BaseException:  # noqa: BLE001
            pass
        # Skip this bootstrap's own frame: the traceback starts in the code.
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None
        traceback.print_exception(type(exc), exc, tb, limit=-5)
    try:
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001
        pass
    status.write(json.dumps({"error": error}) + "\n")
    status.flush()
    os._exit(0 if error is None else 1)


if __name__ == "__main__":
    main()
