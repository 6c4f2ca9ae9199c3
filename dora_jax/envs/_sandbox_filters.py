"""The sandbox child's kernel filters: a seccomp allow-list and a Landlock ruleset.

Loaded by path from ``_sandbox_child.py`` (which imports nothing of ``dora_jax``) and
imported by the tests, which check ``ALLOWED`` against the kernel's syscall table.

The seccomp filter denies by default: a syscall not named here fails with EPERM, a
syscall of another ABI (i386 ``int 0x80``, x32) kills the process. The list is what
CPython needs to run plain Python on open files, memory and threads; nothing that
creates sockets, processes, namespaces, mounts, io_uring rings, BPF programs or
signals for other processes is on it.
"""

import ctypes
import os

# Allowed without condition: files already reachable through the mount namespace and
# Landlock, memory, time, signals to oneself, identity queries.
ALLOWED = frozenset({
    # file I/O
    "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev",
    "preadv2", "pwritev2", "lseek", "close", "fstat", "stat", "lstat", "newfstatat",
    "statx", "open", "openat", "access", "faccessat", "faccessat2", "getdents64",
    "getcwd", "chdir", "fchdir", "readlink", "readlinkat", "mkdir", "mkdirat", "rmdir",
    "unlink", "unlinkat", "rename", "renameat", "renameat2", "ftruncate", "truncate", "fsync",
    "fdatasync", "fadvise64", "flock", "umask", "dup", "dup2", "dup3", "fcntl", "pipe", "pipe2",
    "poll", "ppoll", "select", "pselect6", "statfs", "fstatfs",
    # memory
    "mmap", "munmap", "mprotect", "mremap", "brk", "madvise", "mincore",
    # signals (delivery to oneself only: kill/tgkill below)
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "sigaltstack", "rt_sigpending",
    "rt_sigsuspend", "rt_sigtimedwait", "restart_syscall",
    # threads and synchronisation
    "futex", "set_robust_list", "get_robust_list", "set_tid_address", "sched_yield",
    "sched_getaffinity", "exit", "exit_group", "rseq",
    # identity, time, resources (reading only)
    "getpid", "gettid", "getppid", "getuid", "geteuid", "getgid", "getegid",
    "getgroups", "getresuid", "getresgid", "getpgrp", "getrandom", "clock_gettime",
    "clock_getres", "clock_nanosleep", "nanosleep", "gettimeofday", "time", "uname",
    "sysinfo", "getrusage", "times", "getrlimit",
})
# Allowed only with the arguments checked (see `_conditional_rules`).
CONDITIONAL = frozenset({"ioctl", "prlimit64", "kill", "tgkill", "tkill", "clone"})
# Answered ENOSYS rather than EPERM, so that the C library falls back to a call the
# filter can inspect (clone3 keeps its flags in memory a filter cannot read).
ENOSYS = frozenset({"clone3"})

# TCGETS TIOCGWINSZ FIONREAD FIONCLEX FIOCLEX
_TERMINAL_IOCTLS = (0x5401, 0x5413, 0x541B, 0x5450, 0x5451)
_CLONE_THREAD = 0x00010000
_CLONE_NAMESPACES = 0x7E020080  # NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET|NEWTIME

_ACT_KILL_PROCESS, _ACT_ALLOW = 0x80000000, 0x7FFF0000
_FLTATR_ACT_BADARCH = 2
_CMP_EQ, _CMP_MASKED_EQ = 4, 7
_EPERM, _ENOSYS = 1, 38


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]


def _conditional_rules(pid, threads):
    """(name, [conditions]) pairs; each pair allows the call when all its conditions
    hold. `pid` is this process's own pid (1 inside a pid namespace)."""
    rules = [("ioctl", [_ArgCmp(1, _CMP_MASKED_EQ, 0xFFFFFFFF, request)])
             for request in _TERMINAL_IOCTLS]
    rules.append(("prlimit64", [_ArgCmp(2, _CMP_EQ, 0, 0)]))  # reading a limit only
    rules.append(("kill", [_ArgCmp(0, _CMP_EQ, pid, 0)]))
    rules.append(("tgkill", [_ArgCmp(0, _CMP_EQ, pid, 0)]))
    if threads:  # a thread of this process, never a process nor a namespace
        rules.append(("clone", [_ArgCmp(0, _CMP_MASKED_EQ, _CLONE_THREAD | _CLONE_NAMESPACES,
                                        _CLONE_THREAD)]))
    return rules


def load_seccomp(threads: bool) -> bool:
    """Loads the allow-list filter on this process; False if the host cannot."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        return False
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(0x00050000 | _EPERM)
    if not ctx:
        return False
    try:
        if lib.seccomp_attr_set(ctx, _FLTATR_ACT_BADARCH, _ACT_KILL_PROCESS):
            return False
        none = (_ArgCmp * 1)()
        plain: list[tuple[str, int, list[_ArgCmp]]] = [
            (name, _ACT_ALLOW, []) for name in sorted(ALLOWED)]
        plain += [(name, 0x00050000 | _ENOSYS, []) for name in sorted(ENOSYS)]
        plain += [(name, _ACT_ALLOW, args) for name, args in
                  _conditional_rules(os.getpid(), threads)]
        for name, action, args in plain:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:  # not a syscall of this architecture (e.g. "open" on arm64)
                continue
            array = (_ArgCmp * len(args))(*args) if args else none
            if lib.seccomp_rule_add_array(ctx, action, nr, len(args), array):
                return False
        return lib.seccomp_load(ctx) == 0
    finally:
        lib.seccomp_release(ctx)


# ------------------------------------------------------------------ Landlock

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_TRUNCATE = 1 << 14


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return max(int(libc.syscall(_SYS_CREATE_RULESET, None, 0, 1)), 0)


def load_landlock(readable, writable, device_files, abi_cap=99):
    """Reads beneath `readable`, everything beneath `writable`, read/write of the
    files in `device_files`; no TCP bind or connect; no signals or abstract unix
    sockets outside this domain. Returns the ABI used (0: not applied) and whether
    scoping (ABI 6) was part of it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = min(landlock_abi(), abi_cap)
    if abi < 1:
        return 0, False
    handled = (1 << 13) - 1  # EXECUTE .. MAKE_SYM
    if abi >= 2:
        handled |= 1 << 13  # REFER
    if abi >= 3:
        handled |= _TRUNCATE
    if abi >= 5:
        handled |= 1 << 15  # IOCTL_DEV
    net = 0b11 if abi >= 4 else 0
    scoped = 0b11 if abi >= 6 else 0
    attr = _RulesetAttr(handled, net, scoped)
    size = 8 if abi < 4 else (16 if abi < 6 else 24)
    ruleset = libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        return 0, False
    writes = handled & ~((1 << 6) | (1 << 9) | (1 << 11) | (1 << 15))  # no devices, sockets
    rules = [(p, _EXECUTE | _READ_FILE | (_READ_DIR if os.path.isdir(p) else 0))
             for p in readable]
    rules += [(p, writes) for p in writable]
    rules += [(p, (_READ_FILE | _WRITE_FILE | (_TRUNCATE if abi >= 3 else 0)))
              for p in device_files]
    try:
        for path, allowed in rules:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneath(allowed & handled, fd)
                if libc.syscall(_SYS_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0):
                    return 0, False
            finally:
                os.close(fd)
        if libc.syscall(_SYS_RESTRICT_SELF, ruleset, 0):
            return 0, False
        return abi, abi >= 6
    finally:
        os.close(ruleset)
