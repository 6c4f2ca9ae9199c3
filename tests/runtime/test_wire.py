"""The wire between processes (runtime/wire.py): what crosses it comes back equal,
nothing else crosses, and only a peer holding the run's key connects."""

import multiprocessing.connection
import threading

import numpy as np
import pytest
from conftest import load_repo_config

from dora_jax.rollout.trajectory import InFlight, Request, SliceStats, Trajectory
from dora_jax.runtime import roles, wire


def _trajectory():
    return Trajectory(group_id=3, prompt_id="p-7", sample_index=1, version=2,
                      prompt_tokens=[5, 6], response_tokens=[7, 8, 9],
                      behaviour_logprobs=[-0.5, -1.25, float("-inf")], versions=[[2, 3]],
                      slice_ids=[0, 1], finish_reason="stop", t_submit=0.5, t_start=0.75,
                      t_finish=1.5, episode={"turns": [["model", 0, 3, 0.0]]},
                      routing=np.arange(12, dtype=np.int8).reshape(3, 2, 2))


def test_records_cross_the_wire_unchanged():
    request = Request(group_id=3, prompt_id=11, sample_index=1, prompt_tokens=(5, 6),
                      seed=np.array([1, 2**32 - 1], np.uint32), version=2,
                      record={"prompt": "2+2", "answer": 4})
    stats = SliceStats(generate_calls=4, weight_transfer_seconds=0.25)
    inflight = InFlight.submitted(request, 0, 0.5)
    kind, got = wire.decode(wire.encode(
        "finished", request=request, trajectories=[_trajectory()], stats=stats,
        inflight=inflight, by_id={(3, 1): "a"}, ids=[(3, 1)]))
    assert kind == "finished"
    assert got["request"].prompt_tokens == (5, 6) and got["request"].record == request.record
    np.testing.assert_array_equal(got["request"].seed, request.seed)
    assert got["request"].seed.dtype == np.uint32
    t = got["trajectories"][0]
    assert t == _trajectory()  # routing is not compared by ==
    np.testing.assert_array_equal(t.routing, _trajectory().routing)
    assert t.routing.dtype == np.int8 and t.behaviour_logprobs[-1] == float("-inf")
    assert got["stats"] == stats
    assert got["inflight"].request.request_id == request.request_id
    assert got["by_id"] == {(3, 1): "a"} and got["ids"] == [(3, 1)]


def test_only_known_records_and_plain_arrays_cross():
    class Other:
        pass

    with pytest.raises(TypeError, match="Other does not cross"):
        wire.encode("x", value=Other())
    with pytest.raises(wire.WireError, match="unknown record type 'Popen'"):
        wire.decode(b'{"kind": "x", "fields": {"v": {"__dc__": "Popen", "f": {}}}}')
    with pytest.raises(wire.WireError, match="object arrays"):
        wire.decode(b'{"kind": "x", "fields": {"v": {"__nd__": ["|O", [1], "AAAAAAAAAAA="]}}}')
    with pytest.raises(wire.WireError, match="no field"):
        wire.decode(b'{"kind": "x", "fields": {"v": {"__dc__": "SliceStats", '
                    b'"f": {"evil": 1}}}}')
    with pytest.raises(wire.WireError, match="undecodable"):
        wire.decode(b"\x80\x04not json")


def test_a_link_needs_the_run_s_key(monkeypatch):
    monkeypatch.setenv(wire.AUTHKEY_ENV, wire.new_authkey())
    listener = wire.listen(("127.0.0.1", 0))
    got = {}

    def serve():
        link = wire.accept(listener)
        got["message"] = link.recv()
        link.send("reply", n=got["message"][1]["n"] + 1)

    t = threading.Thread(target=serve)
    t.start()
    link = wire.connect(listener.address)
    link.send("ask", n=41)
    assert link.recv() == ("reply", {"n": 42})
    t.join()
    # A peer without the key is refused in the handshake, before any message.
    monkeypatch.setenv(wire.AUTHKEY_ENV, "another key")
    t = threading.Thread(target=lambda: pytest.raises(Exception, wire.accept, listener))
    t.start()
    with pytest.raises(multiprocessing.connection.AuthenticationError):
        wire.connect(listener.address)
    t.join()
    listener.close()


def test_roles_come_from_the_launcher_s_variables():
    assert roles.from_env({}) == roles.Role()
    env = {roles.NUM_PROCESSES: "3", roles.PROCESS_ID: "2", roles.COORDINATOR: "10.0.0.1:5000"}
    role = roles.from_env(env)
    assert (role.process_id, role.num_processes, role.coordinator) == (2, 3, ("10.0.0.1", 5000))
    assert role.slice_ids_by_process(4) == {1: [0, 1], 2: [2, 3]}
    assert roles.Role(0, 4).slice_ids_by_process(4) == {1: [0], 2: [1, 2], 3: [3]}
    for bad, says in [({roles.PROCESS_ID: "3"}, "DORA_PROCESS_ID=3 is outside 0..2"),
                      ({roles.COORDINATOR: "nowhere"}, "DORA_COORDINATOR='nowhere'"),
                      ({roles.NUM_PROCESSES: "x"}, "DORA_NUM_PROCESSES='x'")]:
        with pytest.raises(ValueError, match=says):
            roles.from_env({**env, **bad})
    with pytest.raises(ValueError, match="more than the config's 1 decode slices"):
        role.slice_ids_by_process(1)
    # Two trainer processes (0 and 1), then the slice processes.
    two = roles.from_env({**env, roles.NUM_PROCESSES: "4", roles.TRAINER_PROCESSES: "2"})
    assert two.trainer_processes == 2 and two.slice_ids_by_process(4) == {2: [0, 1],
                                                                        3: [2, 3]}
    assert not two.trains and two.trainer_service == ("10.0.0.1", 5001)
    assert roles.Role(1, 4, ("h", 1), 2).trains
    assert two.trainer_commands == ("10.0.0.1", 5002)
    for bad in ("0", "3"):  # none, or no process left for the slices
        with pytest.raises(ValueError, match=f"DORA_TRAINER_PROCESSES={bad} leaves no"):
            roles.from_env({**env, roles.TRAINER_PROCESSES: bad})


def test_each_trainer_process_takes_an_equal_share_of_the_trainer_mesh():
    mesh = load_repo_config("configs/tiny.py:spread").mesh  # trainer 4 devices, 4 slices of 1
    assert [roles.Role(p, 5, ("h", 1), 2).devices_needed(mesh) for p in range(5)] == [
        2, 2, 1, 2, 1]  # slice processes 2, 3, 4 hold slices [0], [1, 2], [3]
    with pytest.raises(ValueError, match="DORA_TRAINER_PROCESSES=3 does not divide the "
                                         "trainer mesh's 4 devices"):
        roles.Role(0, 4, ("h", 1), 3).devices_needed(mesh)


def _fake_slice_process(address, process_id, *, then):
    """A slice process that connects, says ready, then does `then(link)`."""
    link = wire.connect(address)
    link.send("hello", process_id=process_id)
    assert link.recv()[0] == "init"
    link.send("ready")
    then(link)


@pytest.mark.parametrize("how", ["silent", "gone"])
def test_a_slice_process_that_hangs_or_dies_fails_its_slices_in_bounded_time(how, monkeypatch):
    """The coordinator's side (runtime/remote.py): a process that stops sending (no
    heartbeat) or whose connection drops fails each of its slices, each once."""
    import queue
    import time

    from dora_jax.base.timeline import Timeline
    from dora_jax.launch.local import free_port
    from dora_jax.runtime import remote
    from dora_jax.runtime.events import Failed

    class NoWeights:
        address = ""

        def offer(self, version, params, *, base_held):
            return 0, []

    monkeypatch.setenv(wire.AUTHKEY_ENV, wire.new_authkey())
    address = ("127.0.0.1", free_port("127.0.0.1"))
    procs = remote.SliceProcesses(address, {1: [0, 1]}, NoWeights(), lambda: (0, None),
                                  heartbeat_timeout=1.0)
    stop = threading.Event()
    then = (lambda link: stop.wait(30)) if how == "silent" else (lambda link: link.close())
    peer = threading.Thread(target=_fake_slice_process, args=(address, 1), kwargs=dict(then=then))
    peer.start()
    procs.wait_ready(30)
    events: queue.Queue = queue.Queue()
    for i in (0, 1):
        procs.worker(procs.slices[i], events, Timeline(), time.perf_counter)
    start = time.monotonic()
    failed = [events.get(timeout=10), events.get(timeout=10)]
    assert time.monotonic() - start < 5
    assert all(isinstance(e, Failed) for e in failed) and {e.source for e in failed} == {0, 1}
    assert all("slice process 1" in str(e.error) for e in failed)
    if how == "silent":
        assert all("sent nothing for 1 s" in str(e.error) for e in failed)
    assert events.empty()
    stop.set()
    peer.join()
    procs.close()
