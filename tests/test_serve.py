"""dora_jax.serve: a trained run's checkpoint answered through JetStream's own server.

The serving settings are checked everywhere. Serving itself needs JetStream and its
server's dependencies (`pip install -e ".[jetstream]"`, JETSTREAM_SRC=<its checkout>)
and is skipped without them: a quickstart run trains two steps; `python -m
dora_jax.serve` answers prompts from its checkpoint through JetStream's orchestrator,
then JetStream's gRPC client through its server on a port; each greedy answer equals
the full forward of the checkpoint's params.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import REPO

from dora_jax import serve

QUICKSTART = "configs/quickstart.py"
_SRC = os.environ.get("JETSTREAM_SRC")


def _jetstream_missing() -> list:
    """serve.missing_modules(), JetStream counted as present in JETSTREAM_SRC."""
    in_src = bool(_SRC) and os.path.isdir(os.path.join(_SRC, "jetstream"))
    return [m for m in serve.missing_modules() if not (m == "jetstream" and in_src)]


def test_the_longest_prompt_rises_to_one_of_jetstream_s_buckets(load_config):
    cfg = load_config(QUICKSTART)
    assert cfg.rollout.max_prefill_length == 48  # not one of JetStream's
    r = serve.serving_rollout(cfg, slots=4, max_tokens=8)
    assert r.max_prefill_length == 64 and r.slots_per_slice == 4
    assert {48, 64} <= set(r.prefill_buckets)
    tiny = load_config("configs/tiny.py:spread")
    assert serve.serving_rollout(tiny, slots=8, max_tokens=8).max_prefill_length == 16


def test_responses_beyond_the_decode_length_are_refused(load_config):
    cfg = load_config(QUICKSTART)
    with pytest.raises(ValueError, match="max_tokens=17"):
        serve.serving_rollout(cfg, slots=4, max_tokens=cfg.rollout.max_decode_len + 1)


def test_without_jetstream_serving_stops_before_any_compute_naming_what_to_install():
    if not _jetstream_missing():
        pytest.skip("JetStream is installed here")
    out = subprocess.run([sys.executable, "-m", "dora_jax.serve", f"--config={QUICKSTART}",
                          "--prompt=Calculate 7 - 3."], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert "serving needs" in line and ".[jetstream]" in line


def test_prompts_are_built_as_training_built_them_and_too_long_ones_are_named(load_config):
    from dora_jax.tasks import sources

    cfg = load_config(QUICKSTART)
    tokenizer = sources.tokenizer_for(cfg)
    record = sources.prompt_records(cfg, tokenizer)[0][0]
    (ids,) = serve.prompt_tokens(cfg, tokenizer, [record["question"]], raw=False,
                                 max_length=64)
    assert ids == record["tokens"]
    assert serve.prompt_tokens(cfg, tokenizer, ["7 - 3"], raw=True,
                               max_length=64) == [tokenizer.encode("7 - 3")]
    with pytest.raises(ValueError, match=r"--prompt='Calculate.*tokens, more than the 64"):
        serve.prompt_tokens(cfg, tokenizer, ["Calculate " + "9 + " * 40 + "1."], raw=False,
                            max_length=64)


def test_the_buckets_are_jetstream_s():
    spec = importlib.util.find_spec("jetstream")
    if spec is None and _SRC:
        sys.path.insert(0, _SRC)
    token_utils = pytest.importorskip("jetstream.engine.token_utils")
    assert list(serve.JETSTREAM_BUCKETS) == token_utils.DEFAULT_PREFILL_BUCKETS


@pytest.mark.slow
def test_serve_answers_from_a_trained_quickstart_checkpoint(load_config, tmp_path):
    missing = _jetstream_missing()
    if missing:
        pytest.skip(f"serving needs {missing} (pip install -e '.[jetstream]'; "
                    f"JETSTREAM_SRC=<JetStream checkout>)")
    import jax

    from dora_jax.export import newest_params
    from dora_jax.model import transformer
    from dora_jax.tasks import sources

    steps = ["--config.coordinator.num_steps=2", "--config.eval.every=0"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_SRC, env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, "-m", "dora_jax.main", f"--config={QUICKSTART}",
                          f"--workdir={tmp_path}", *steps], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    questions = ["Calculate 7 - 3.", "Calculate 2 + 5.", "Calculate 9 - 8."]
    port = _free_port()
    errors = open(tmp_path / "serve.err", "w+")
    server = subprocess.Popen(
        [sys.executable, "-m", "dora_jax.serve", f"--config={QUICKSTART}",
         f"--workdir={tmp_path}", "--slots=2", "--max_tokens=12", "--json",
         f"--port={port}", *[f"--prompt={q}" for q in questions]],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=errors, text=True)
    try:
        stdout = _reader(server)
        lines = _lines_until(stdout, f"listening on port {port}", timeout_s=600)
        # JetStream's own gRPC client, a text request: the server tokenizes it.
        if _SRC:
            sys.path.insert(0, _SRC)
        grpc_ids = _grpc_decode(port, questions[0], max_tokens=12)
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=120)
    rest = _lines_until(stdout, None, timeout_s=10)
    errors.seek(0)
    assert server.returncode == 0, errors.read()[-3000:]
    assert "serving step 2 of" in lines[0] and "stopped" in rest

    cfg = load_config(QUICKSTART)
    step, params = newest_params(cfg, str(tmp_path))
    assert step == 2
    graphdef, _ = transformer.abstract_params(cfg.model)
    forward = jax.jit(lambda p, x: transformer.apply(graphdef, p, x, dropless=True)[0])
    tokenizer = sources.tokenizer_for(cfg)
    stops = {cfg.rollout.eos_id, *tokenizer.stop_ids}

    def greedy(prompt):
        seq = list(prompt)
        for _ in range(12):
            x = np.zeros((1, 64 + 12), np.int32)
            x[0, :len(seq)] = seq
            seq.append(int(np.argmax(np.asarray(forward(params, x))[0, len(seq) - 1])))
            if seq[-1] in stops:
                break
        return seq[len(prompt):]

    answers = [json.loads(line) for line in lines if line.startswith("{")]
    assert [a["prompt"] for a in answers] == questions
    prompts = serve.prompt_tokens(cfg, tokenizer, questions, raw=False, max_length=64)
    for got, prompt in zip(answers, prompts):
        assert got["ids"] == greedy(prompt), got["prompt"]
        assert got["text"] == tokenizer.decode(got["ids"], skip_special_tokens=True)
    assert grpc_ids == greedy(tokenizer.encode(questions[0]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _reader(proc) -> queue.Queue:
    """`proc`'s stdout lines, read on a thread; None at its end."""
    out: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [out.put(x) for x in iter(proc.stdout.readline, "")]
                     + [out.put(None)], daemon=True).start()
    return out


def _lines_until(out: queue.Queue, last: str | None, timeout_s: float) -> list:
    """Lines from `out` up to the one that starts with `last` (None: to the end)."""
    lines, deadline = [], time.monotonic() + timeout_s
    while True:
        line = out.get(timeout=max(0.1, deadline - time.monotonic()))
        if line is None:
            assert last is None, f"the server exited: {lines[-5:]}"
            return lines
        lines.append(line.rstrip("\n"))
        if last is not None and line.startswith(last):
            return lines


def _grpc_decode(port: int, text: str, *, max_tokens: int) -> list:
    import grpc
    from jetstream.core.proto import jetstream_pb2 as pb
    from jetstream.core.proto import jetstream_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"localhost:{port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=60)
        req = pb.DecodeRequest(text_content=pb.DecodeRequest.TextContent(text=text),
                               max_tokens=max_tokens)
        ids: list = []
        for resp in pb_grpc.OrchestratorStub(channel).Decode(req, timeout=120):
            for sample in resp.stream_content.samples:
                ids.extend(sample.token_ids)
    return ids
