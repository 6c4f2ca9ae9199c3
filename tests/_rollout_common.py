"""Shared fixtures for test_engine.py / test_slice.py: small models, params, engines
(cached so both files reuse compiled functions) and full-forward references.

The references never go through the engine: they run `transformer.apply` on the
whole sequence (dropless MoE) and pick tokens with numpy.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from conftest import TINY, load_repo_config

from dora_jax.config.devices import make_meshes
from dora_jax.model import transformer
from dora_jax.rollout import DecodeSlice, Engine, SamplingParams

SLOTS = 4
MAX_PROMPT = 8
MAX_DECODE = 12
TEMPERATURE = 0.7
TOP_K = 5
# Prompt lengths 3..8 (all in the one prompt bucket of 8).
PROMPTS = [[5, 17, 9], [40, 2, 77, 31, 8], [3, 3, 3, 3, 3, 3, 3, 3], [99, 12, 64, 7],
           [21, 22, 23, 24, 25, 26], [120, 4, 55, 90, 11, 6, 70]]


@functools.cache
def config(model: str):
    """"dense" or "moe": the tiny configs, loaded as the `load_config` fixture does."""
    return load_repo_config(TINY[model], num_devices=8)


@functools.cache
def meshes():
    """(trainer mesh on devices 0-3, [slice meshes on devices 4, 5, 6, 7])."""
    return make_meshes(config("dense").mesh)


@functools.cache
def params(model: str, seed: int):
    return transformer.create(config(model).model, seed)[1]


@functools.cache
def _forward(model: str):
    graphdef = transformer.create(config(model).model, 0)[0]
    return jax.jit(lambda p, x: transformer.apply(graphdef, p, x, dropless=True)[0])


def forward_logits(model, p, seqs) -> list:
    """Full-forward logits [len, V] (f32 numpy) of each sequence, causal, padded to
    one fixed length so the reference compiles once."""
    L = MAX_PROMPT + MAX_DECODE
    x = np.zeros((len(seqs), L), np.int32)
    for i, s in enumerate(seqs):
        x[i, :len(s)] = s
    logits = np.asarray(_forward(model)(p, x))
    return [logits[i, :len(s)] for i, s in enumerate(seqs)]


def greedy_reference(model, p, prompts, eos, steps=MAX_DECODE) -> list:
    """Greedy responses by repeated full forward (argmax), stopping after EOS."""
    seqs, done = [list(q) for q in prompts], [False] * len(prompts)
    for _ in range(steps):
        logits = forward_logits(model, p, seqs)
        for i, lg in enumerate(logits):
            if not done[i]:
                seqs[i].append(int(np.argmax(lg[-1])))
                done[i] = seqs[i][-1] == eos
    return [s[len(q):] for s, q in zip(seqs, prompts)]


def logsumexp(x):
    m = np.max(x)
    return m + np.log(np.sum(np.exp(x - m)))


def logprob_reference(model, p, prompt, response, temperature) -> np.ndarray:
    """log softmax(logits / T) of each response token, from one full forward."""
    (lg,) = forward_logits(model, p, [list(prompt) + list(response)])
    z = lg[len(prompt) - 1:-1].astype(np.float64) / temperature
    return np.array([zi[t] - logsumexp(zi) for zi, t in zip(z, response)])


@functools.cache
def eos_id() -> int:
    """An EOS token that ends some greedy references early and not others, so
    requests have different lengths (chosen from the references, not the engine)."""
    refs = greedy_reference("dense", params("dense", 0), PROMPTS, eos=-1)
    best = None
    for tok in sorted({t for r in refs for t in r} - {0}):
        lengths = {r.index(tok) + 1 if tok in r else MAX_DECODE for r in refs}
        if best is None or len(lengths) > best[0]:
            best = (len(lengths), tok)
    return best[1]


# Tokens per generate call: 5 does not divide MAX_DECODE, so requests end mid-call.
DECODE_STEPS = 5
# KV pages of 4 positions: prompts and responses cross page boundaries, some prompts
# fill whole pages (length 8) and some do not.
PAGE_SIZE = 4


def rollout(decode_steps=DECODE_STEPS, kv_cache="paged", kv_pages=0, paged_attention="auto"):
    base = config("dense").rollout
    return dataclasses.replace(base, slots_per_slice=SLOTS, max_prefill_length=MAX_PROMPT,
                               max_decode_len=MAX_DECODE, prefill_buckets=(MAX_PROMPT,),
                               temperature=1.0, top_k=0, top_p=1.0, eos_id=eos_id(),
                               decode_steps=decode_steps, kv_cache=kv_cache,
                               page_size=PAGE_SIZE, kv_pages=kv_pages,
                               paged_attention=paged_attention)


SAMPLING = {
    "greedy": SamplingParams(greedy=True),
    "sampled": SamplingParams(temperature=TEMPERATURE),
    "topk": SamplingParams(temperature=0.8, top_k=TOP_K),
}


@functools.cache
def engine(model: str, kind: str, mesh_index: int, decode_steps=DECODE_STEPS,
           kv_cache="paged", kv_pages=0, paged_attention="auto") -> Engine:
    """One engine per (model, sampling kind, slice mesh, tokens per call, KV layout),
    shared by the test files. A slice built on it resets its page pool."""
    return Engine(config(model).model, rollout(decode_steps, kv_cache, kv_pages, paged_attention),
                  meshes()[1][mesh_index], sampling_params=SAMPLING[kind])


def make_slice(slice_id, model, kind, mesh_index, version=0, seed=0, lookahead=True,
               decode_steps=DECODE_STEPS, kv_cache="paged", kv_pages=0,
               paged_attention="auto") -> DecodeSlice:
    s = DecodeSlice(slice_id, engine(model, kind, mesh_index, decode_steps, kv_cache,
                                     kv_pages, paged_attention), lookahead=lookahead)
    s.load_version(version, params(model, seed))
    return s


def paged_attention_reference(q_BHD, k_KPpD, v_KPpD, lengths, tables):
    """Per slot: its pages concatenated, the first `length` positions, softmax."""
    B, H, D = q_BHD.shape
    K = k_KPpD.shape[0]
    out = np.zeros((B, H, D))
    for b in range(B):
        if not lengths[b]:
            continue
        k = np.concatenate([k_KPpD[:, p] for p in tables[b]], axis=1)[:, :lengths[b]]
        v = np.concatenate([v_KPpD[:, p] for p in tables[b]], axis=1)[:, :lengths[b]]
        for h in range(H):
            s = k[h // (H // K)] @ q_BHD[b, h] / np.sqrt(D)
            p = np.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ v[h // (H // K)]
    return out
