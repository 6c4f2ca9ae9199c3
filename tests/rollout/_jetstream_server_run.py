"""Serves our Engine with JetStream's own server loop (`jetstream.core.orchestrator`,
imported from JetStream's checkout or package, unmodified) and prints what came back
as JSON, with the full-forward greedy references.

Run as a separate process by test_jetstream_server.py: a JetStream server thread that
fails kills its whole process (SIGKILL), which a test process must survive to report.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import threading  # noqa: E402

import _rollout_common as rc  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

import dora_jax  # noqa: E402
from dora_jax.model import transformer  # noqa: E402
from dora_jax.rollout import Engine, SamplingParams  # noqa: E402
from dora_jax.text.tokenizer import Tokenizer  # noqa: E402

TOKENIZER = os.path.join(os.path.dirname(dora_jax.__file__), "assets", "tokenizer")
SLOTS = 4
MAX_PROMPT = 16  # one of JetStream's padding buckets, as its server requires
MAX_DECODE = 12
TEXTS = ["The cat sat on the mat.", "Two plus two is", "hello world"]


def setup():
    tok = Tokenizer.from_pretrained(TOKENIZER)
    base = rc.config("dense")
    model = dataclasses.replace(base.model, vocab_size=tok.vocab_size)
    graphdef, params = transformer.create(model, 0)
    forward = jax.jit(lambda p, x: transformer.apply(graphdef, p, x, dropless=True)[0])

    def greedy(prompt, steps):
        seq = list(prompt)
        for _ in range(steps):
            x = np.zeros((1, MAX_PROMPT + MAX_DECODE), np.int32)
            x[0, :len(seq)] = seq
            seq.append(int(np.argmax(np.asarray(forward(params, x))[0, len(seq) - 1])))
        return seq[len(prompt):]

    # A second stop id that some greedy responses reach, so requests end both ways.
    refs = [greedy(p, MAX_DECODE) for p in rc.PROMPTS]
    counts: dict = {}
    for r in refs:
        for t in set(r[2:8]):
            counts[t] = counts.get(t, 0) + 1
    extra = min(counts, key=lambda t: (abs(counts[t] - 2), t))
    rollout = dataclasses.replace(
        base.rollout, slots_per_slice=SLOTS, max_prefill_length=MAX_PROMPT,
        max_decode_len=MAX_DECODE, prefill_buckets=(8, MAX_PROMPT), eos_id=tok.eos_id,
        temperature=1.0, top_k=0, top_p=1.0, kv_cache="paged", page_size=4)
    return tok, model, params, rollout, (tok.eos_id, extra), greedy


def requests(tok):
    from jetstream.core.proto import jetstream_pb2 as pb
    out = []
    for i, p in enumerate(rc.PROMPTS):  # token requests: the prompt as given (no BOS)
        out.append((list(p), 4 + (i * 3) % (MAX_DECODE - 3), pb.DecodeRequest(
            token_content=pb.DecodeRequest.TokenContent(token_ids=p), has_bos=True,
            max_tokens=4 + (i * 3) % (MAX_DECODE - 3))))
    for i, text in enumerate(TEXTS):
        out.append((tok.encode(text), MAX_DECODE - i, pb.DecodeRequest(
            text_content=pb.DecodeRequest.TextContent(text=text),
            max_tokens=MAX_DECODE - i)))
    return out


async def serve(orchestrator, driver, reqs, num_samples):
    client = orchestrator.LLMOrchestrator(driver=driver)

    async def one(req):
        req.num_samples = num_samples
        samples = [{"ids": [], "text": ""} for _ in range(num_samples)]
        async for resp in client.Decode(req):
            for s, got in zip(samples, resp.stream_content.samples):
                s["ids"].extend(got.token_ids)
                s["text"] += got.text
        return samples

    return await asyncio.wait_for(asyncio.gather(*(one(r) for _, _, r in reqs)), 300)


def main():
    from jetstream.core import orchestrator
    from jetstream.engine import engine_api

    tok, model, params, rollout, stops, greedy = setup()
    meshes = rc.meshes()[1]
    engines = {}

    def engine(kind, i):
        if (kind, i) not in engines:
            sp = SamplingParams(greedy=True) if kind == "greedy" else SamplingParams(0.7)
            engines[kind, i] = Engine(model, rollout, meshes[i], sampling_params=sp,
                                      tokenizer_path=TOKENIZER, stop_ids=stops)
        return engines[kind, i]

    reqs = requests(tok)
    # One event loop for all runs, open until every server has stopped: JetStream's
    # return channel still schedules work on the loop after its last response.
    loop = asyncio.new_event_loop()
    report = {"stops": list(stops), "vocab": tok.vocab_size, "runs": {},
              "is_engine": isinstance(engine("greedy", 0), engine_api.Engine)}
    # (name, sampling, interleaved, multi-sampling samples per request)
    for name, kind, interleaved, n in [("interleaved_greedy", "greedy", True, 1),
                                       ("disaggregated_greedy", "greedy", False, 1),
                                       ("disaggregated_sampled", "sampled", False, 1),
                                       ("interleaved_sampled", "sampled", True, 1),
                                       ("multisampling_greedy", "greedy", False, 2)]:
        if os.environ.get("ONLY") and name not in os.environ["ONLY"].split(","):
            continue
        pre = engine(kind, 0)
        gen = pre if interleaved else engine(kind, 1)
        p_pre, p_gen = pre.load_params(params), gen.load_params(params)
        driver = orchestrator.Driver(prefill_engines=[pre], generate_engines=[gen],
                                     prefill_params=[p_pre], generate_params=[p_gen],
                                     interleaved_mode=interleaved, multi_sampling=n > 1)
        got = loop.run_until_complete(serve(orchestrator, driver, reqs, n))
        alive = all(t.is_alive() for t in driver._all_threads)
        driver.stop()
        runs = []
        for (prompt, max_tokens, req), samples in zip(reqs, got):
            ref = greedy(prompt, max_tokens)
            cut = next((i + 1 for i, t in enumerate(ref) if t in stops), len(ref))
            # The server streams each token's text (none for token requests).
            text = "".join(tok.decode([t]) for t in ref[:cut] if t not in stops)
            runs.append({"prompt": prompt, "max_tokens": max_tokens, "samples": samples,
                         "greedy": ref[:cut],
                         "greedy_text": text if req.HasField("text_content") else ""})
        report["runs"][name] = {"alive": alive, "requests": runs,
                                "threads": sorted(t.name for t in threading.enumerate())}
        print(f"{name}: done", file=sys.stderr, flush=True)
    loop.close()
    print("JSON:" + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
