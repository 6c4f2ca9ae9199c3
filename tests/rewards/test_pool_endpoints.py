"""No process of a running reward pool can be reached by another process: neither a
worker nor any server of the pool listens on a unix socket, and an attacker process of
the same user that hunts for multiprocessing's endpoints and sends each a pickle that
would create a file when unpickled creates nothing. A control runs the same attacker
against Python's own forkserver, to show that it would get in where one listens."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from dora_jax.rewards.pool import RewardPool

_ACCEPTCON = 0x10000  # __SO_ACCEPTCON in /proc/net/unix: the socket listens


def echo(record, response):
    return float(len(response))


def descendants(root: int) -> set[int]:
    """Pids of every process below `root` (children, their children, ...)."""
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    # The name field may hold spaces and parentheses: split after it.
                    parent[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # it ended meanwhile
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    return found


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def listening_unix_sockets() -> dict[int, str]:
    """Inode -> path ('@name' when abstract, '' when unnamed) of every listening
    unix socket on the host."""
    out = {}
    with open("/proc/net/unix") as f:
        next(f)  # the header
        for line in f:
            fields = line.split()
            if int(fields[3], 16) & _ACCEPTCON:
                out[int(fields[6])] = fields[7] if len(fields) > 7 else ""
    return out


def test_no_process_of_the_pool_listens_on_a_unix_socket():
    with RewardPool(echo, num_workers=2) as pool:
        for _ in range(4):  # every worker is up
            assert pool.submit({}, [1, 2]).result(120) == (2.0, None)
        procs = descendants(os.getpid())
        assert len(procs) >= 2, procs  # the workers are there to be inspected
        held = {inode: pid for pid in procs for inode in socket_inodes(pid)}
        listening = {inode: (held[inode], path)
                     for inode, path in listening_unix_sockets().items() if inode in held}
    assert listening == {}, f"listening (inode: (pid, path)): {listening}"


# A separate process of the same user. It looks for multiprocessing's sockets in temp
# directories (pymp-*), and for any listening unix socket held by a process below the
# pid it is given (the run's pid: an attacker could find it in /proc). To each it
# speaks the forkserver's request (fds of a pipe, then a pickle on that pipe, which a
# forked child unpickles) and also sends the pickle on the socket itself, framed as a
# multiprocessing Connection message. Unpickling the payload creates SENTINEL.
ATTACKER = textwrap.dedent("""
    import glob, json, os, pickle, socket, stat, struct, sys, tempfile, time
    target, sentinel = int(sys.argv[1]), sys.argv[2]

    class Payload:
        def __reduce__(self):
            return (open, (sentinel, "w"))

    payload = pickle.dumps(Payload())

    def below(root):
        parent = {}
        for name in os.listdir("/proc"):
            try:
                with open(f"/proc/{name}/stat") as f:
                    parent[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
        found, frontier = {root}, {root}
        while frontier:
            frontier = {p for p, pp in parent.items() if pp in frontier} - found
            found |= frontier
        return found

    held = set()
    for pid in below(target):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    held.add(int(link[8:-1]))
        except OSError:
            pass
    addresses = set()
    roots = {tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"}
    for root in roots:
        for path in glob.glob(os.path.join(root, "pymp-*", "*")):
            try:
                if stat.S_ISSOCK(os.stat(path).st_mode):
                    addresses.add(path)
            except OSError:
                pass
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            fields = line.split()
            name = fields[7] if len(fields) > 7 else ""
            listens = int(fields[3], 16) & 0x10000
            if listens and name and (int(fields[6]) in held or "pymp-" in name
                                     or name.startswith("@listener-")):
                addresses.add("\\0" + name[1:] if name.startswith("@") else name)
    tried = {}
    for address in sorted(addresses):
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(5)
                s.connect(address)
                r, w = os.pipe()
                status_r, status_w = os.pipe()
                fds = [r, status_w, os.dup(w), os.dup(w)]
                socket.send_fds(s, [bytes([len(fds)])], fds)
                os.write(w, payload)
                os.close(w)
                tried[address] = "sent"
                try:  # a forkserver has closed the socket by now
                    s.sendall(struct.pack("!i", len(payload)) + payload)
                    time.sleep(0.5)
                except OSError:
                    pass
        except OSError as e:
            tried[address] = f"{type(e).__name__}: {e}"
    print(json.dumps(tried))
""")


def attack(pid: int, sentinel) -> dict:
    done = subprocess.run([sys.executable, "-c", ATTACKER, str(pid), str(sentinel)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    tried = json.loads(done.stdout.strip().splitlines()[-1])
    deadline = time.monotonic() + 5  # a forked child may unpickle a moment later
    while not sentinel.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return tried


def test_an_attacker_of_the_same_user_cannot_reach_the_pool(tmp_path):
    sentinel = tmp_path / "pwned"
    with RewardPool(echo, num_workers=2) as pool:
        for _ in range(4):
            assert pool.submit({}, [1]).result(120) == (1.0, None)
        tried = attack(os.getpid(), sentinel)
        assert pool.submit({}, [1, 2, 3]).result(120) == (3.0, None)  # still scoring
    assert not sentinel.exists(), f"code ran through one of {tried}"


# Python 3.14 authenticates its forkserver's clients; before it, any process of the
# user that connects is served.
@pytest.mark.skipif(sys.version_info >= (3, 14), reason="the forkserver authenticates")
def test_control_the_attacker_gets_into_an_unauthenticated_forkserver(tmp_path):
    sentinel = tmp_path / "pwned"
    victim = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import multiprocessing, sys, time
            if __name__ == "__main__":
                p = multiprocessing.get_context("forkserver").Process(target=time.sleep,
                                                                      args=(60,))
                p.start()
                print("up", flush=True)
                sys.stdin.read()
                p.kill()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout.readline().strip() == "up"
        tried = attack(victim.pid, sentinel)
    finally:
        victim.stdin.close()
        victim.wait(30)
    assert any(v == "sent" for v in tried.values()), tried
    assert sentinel.exists(), tried
