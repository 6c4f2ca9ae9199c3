"""JetStream's own continuous-batching server loop (`jetstream.core.orchestrator` at
JetStream's final commit, unmodified) serving our Engine, unmodified: token and text
requests at once, more requests than slots, greedy and sampled, interleaved and
disaggregated modes, multi-sampling, paged KV.

Needs JetStream and its server's dependencies (`pip install -e ".[jetstream]"`, and
JetStream's checkout on PYTHONPATH or in JETSTREAM_SRC); skipped without them. The
server runs in a child process: one of its threads failing kills that process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

_SRC = os.environ.get("JETSTREAM_SRC")
_NEEDED = ("grpc", "prometheus_client", "shortuuid", "seqio", "transformers", "tiktoken")


def _importable(name: str) -> bool:
    if name == "jetstream" and _SRC:
        return os.path.isdir(os.path.join(_SRC, "jetstream"))
    return importlib.util.find_spec(name) is not None


@pytest.fixture(scope="module")
def report():
    missing = [m for m in ("jetstream", *_NEEDED) if not _importable(m)]
    if missing:
        pytest.skip(f"JetStream's server needs {missing} (pip install -e '.[jetstream]'; "
                    f"JETSTREAM_SRC=<JetStream checkout>)")
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (_SRC, os.path.dirname(here), env.get("PYTHONPATH")) if p)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.join(here, "_jetstream_server_run.py")],
                          env=env, capture_output=True, text=True, timeout=560)
    tail = (proc.stdout + proc.stderr)[-6000:]
    # A server thread that raises prints its error and SIGKILLs the process.
    assert proc.returncode == 0, f"server process exited with {proc.returncode}:\n{tail}"
    assert "encountered an error" not in proc.stdout, tail
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("JSON:")]
    return json.loads(line[5:])


def test_engine_is_a_jetstream_engine(report):
    assert report["is_engine"]


@pytest.mark.parametrize("run", ["interleaved_greedy", "disaggregated_greedy",
                                 "multisampling_greedy"])
def test_greedy_responses_equal_the_full_forward(report, run):
    r = report["runs"][run]
    assert r["alive"], "a server thread died"
    for req in r["requests"]:
        for s in req["samples"]:
            assert s["ids"] == req["greedy"], req["prompt"]
            assert s["text"] == req["greedy_text"], req["prompt"]


@pytest.mark.parametrize("run", ["disaggregated_sampled", "interleaved_sampled"])
def test_sampled_responses_end_at_a_stop_id_or_max_tokens(report, run):
    r = report["runs"][run]
    assert r["alive"], "a server thread died"
    stops, seen = set(report["stops"]), set()
    for req in r["requests"]:
        (s,) = req["samples"]
        ids = s["ids"]
        assert ids and all(0 <= t < report["vocab"] for t in ids)
        assert len(ids) == req["max_tokens"] or (ids[-1] in stops and len(ids) <= req["max_tokens"])
        assert not stops & set(ids[:-1])
        seen.add(tuple(ids))
    assert len(seen) > 1
