"""The attacker's code at the kernel interface: raw system calls the filter must deny,
other ABIs it must kill at the first instruction, and attempts to switch off the
interpreter-level guards (which must not matter: the layers below hold regardless).
Templates of bench/sandbox_corpus.py's cases; PRELUDE gives every case its helpers."""

PRELUDE = r'''
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

SYSCALLS = {
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
OTHER_ABI = r'''
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

GUARDS = {
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
