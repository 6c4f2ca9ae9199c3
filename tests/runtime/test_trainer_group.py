"""The lead's side of a trainer over several processes (runtime/trainer_group.py),
against stand-in trainer processes on the wire: every command reaches every process
in the lead's order, a process that never connects is one clear error, and a process
id outside the trainer is refused."""

import socket
import threading

import pytest

from dora_jax.runtime import trainer_process, wire
from dora_jax.runtime.trainer_group import TrainerGroup, TrainerProcessLost


def _free_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return "127.0.0.1", s.getsockname()[1]


def _stand_in(address, process_id, got):
    """A trainer process that records each command until `stop`."""
    def run():
        link = trainer_process.connect(address, process_id, timeout=10)
        while True:
            kind, m = link.recv()
            got.append((kind, m))
            if kind == "stop":
                return
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture(autouse=True)
def _key(monkeypatch):
    monkeypatch.setenv(wire.AUTHKEY_ENV, wire.new_authkey())


def test_every_command_reaches_every_trainer_process_in_order():
    address = _free_address()
    group = TrainerGroup(address, 3, timeout=10)
    logs = {1: [], 2: []}
    threads = [_stand_in(address, p, logs[p]) for p in (2, 1)]  # in any order
    group.send("warmup", batch_size=8, group_size=4)
    group.send("train_step", batch={"rewards_B": [0.5, 1.0], "group_ids": (3, 4)})
    group.send("published_params", adapters_only=True)
    group.close()
    for t in threads:
        t.join(10)
    for p in (1, 2):
        assert [k for k, _ in logs[p]] == ["warmup", "train_step", "published_params", "stop"]
        assert logs[p][1][1]["batch"]["group_ids"] == (3, 4)


def test_a_trainer_process_that_never_connects_is_named():
    group = TrainerGroup(_free_address(), 3, timeout=0.5)
    with pytest.raises(TrainerProcessLost, match=r"trainer process\(es\) \[1, 2\] did not "
                                                 "connect within 0.5 s"):
        group.send("warmup", batch_size=8, group_size=4)
    group.close()


def test_a_process_id_outside_the_trainer_is_refused():
    address = _free_address()
    group = TrainerGroup(address, 2, timeout=10)
    link = wire.connect(address)
    link.send("hello", process_id=5)  # a slice process's id, say
    kind, m = link.recv()
    assert kind == "refused" and "no trainer slot for process 5" in m["reason"]
    logs: list = []
    t = _stand_in(address, 1, logs)
    group.send("published_params", adapters_only=False)
    group.close()
    t.join(10)
    assert [k for k, _ in logs] == ["published_params", "stop"]
