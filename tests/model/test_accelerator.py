"""Kernels as compiled for the device JAX runs on, against independent numpy
references: full-sequence attention (forward and gradients, grouped-query heads,
packed rows), paged decode attention, dropless MoE, and the bf16 log-probs of the
decode engine against the trainer's full forward of the same tokens.

`jax.default_backend()` decides which implementations are collected: on CPU the
Pallas kernels run interpreted, on TPU compiled, and cudnn only on GPU. `python -m
dora_jax.bench.accelerator` runs the file (`-m accelerator`) on a GPU or TPU; CI
runs it on CPU. With DORA_ACCELERATOR_RECORDS set, every comparison appends its
figures (max abs error, tolerance, ...) to that file as one JSON line."""

import contextlib
import dataclasses
import json
import os

import _rollout_common as rc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY, load_repo_config
from flax import nnx
from jax.sharding import Mesh
from test_attention import PACKED_21, _naive, _naive_probs, _segments
from test_moe import CFG as MOE_CFG
from test_moe import _reference_moe

from dora_jax import config as config_lib
from dora_jax.model import attention, moe, transformer
from dora_jax.model import paged_attention as pa
from dora_jax.rl import objective, packing
from dora_jax.rl.batch import TrainBatch
from dora_jax.rollout import DecodeSlice, Request
from dora_jax.rollout.pages import PagePool

pytestmark = pytest.mark.accelerator

BACKEND = jax.default_backend()
INTERPRET = BACKEND != "tpu"  # the Pallas TPU kernels run interpreted elsewhere
ATTENTION = {"cpu": ("dense", "blockwise", "splash"), "gpu": ("dense", "blockwise", "cudnn"),
             "tpu": ("dense", "blockwise", "splash")}.get(BACKEND, ("dense", "blockwise"))
PAGED = {"cpu": ("pool", "ragged", "pallas", "pallas_gpu"), "tpu": ("pool", "ragged", "pallas"),
         "gpu": ("pool", "ragged", "pallas_gpu")}.get(BACKEND, ("pool", "ragged"))
# Largest error allowed, as a fraction of the reference's scale (max(1, max |ref|)):
# f32 at "highest" matmul precision (by default GPUs take TF32 and TPUs bf16 passes);
# bf16 a few of its 2^-8 roundings (CPU's worst seen: 0.0063).
TOL = {"float32": 1e-4, "bfloat16": 2e-2}


@pytest.fixture
def record(request):
    """`record(name, **figures)`: one JSON line (test, backend, device kind, name,
    figures) appended to the file DORA_ACCELERATOR_RECORDS names; nothing without it."""
    path = os.environ.get("DORA_ACCELERATOR_RECORDS")

    def write(name, **figures):
        if path:
            line = {"test": request.node.nodeid, "backend": BACKEND,
                    "device_kind": jax.devices()[0].device_kind, "name": name, **figures}
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")
    return write


def _compare(record, name, got, want, tol, **figures):
    """Records, then asserts, max |got - want| <= tol * max(1, max |want|)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = float(np.max(np.abs(got - want)))
    bound = tol * max(1.0, float(np.max(np.abs(want))))
    record(name, max_abs_err=err, tol=bound, **figures)
    assert err <= bound, f"{name}: max abs error {err:.3g} > {bound:.3g} ({figures})"


def _precision(dtype):
    """f32 checks at full f32 matmul precision; bf16 ones as the backend does them."""
    if dtype == "float32":
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


def _exact(x, dtype):
    """x rounded to `dtype` (what the kernel sees) and that value as float64."""
    x = jnp.asarray(x).astype(dtype)
    return x, np.asarray(x.astype(jnp.float32), np.float64)


# ----------------------------------------------------------------------- attention

def _attention_grads(q, k, v, d_out, segment_ids=None):
    """d(sum(out * d_out)) / d(q, k, v), written out per head with numpy (float64):
    dV = P^T dO, dS = P * (dP - rowsum(P * dP)), dQ = dS K / sqrt(D), dK = dS^T Q / sqrt(D)."""
    B, T, H, D = q.shape
    G = H // k.shape[2]
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    probs = _naive_probs(q, k, segment_ids)
    for b in range(B):
        for h in range(H):
            p = probs[b, h]
            dp = d_out[b, :, h] @ v[b, :, h // G].T
            ds = p * (dp - (p * dp).sum(-1, keepdims=True))
            dv[b, :, h // G] += p.T @ d_out[b, :, h]
            dq[b, :, h] = ds @ k[b, :, h // G] / np.sqrt(D)
            dk[b, :, h // G] += ds.T @ q[b, :, h] / np.sqrt(D)
    return dq, dk, dv


# cudnn takes fp16/bf16 only.
_ATTENTION_CASES = [(i, d) for i in ATTENTION for d in ("float32", "bfloat16")
                    if i != "cudnn" or d == "bfloat16"]


def _run_attention(impl, dtype, shape, block, segment_ids=None, seed=0):
    """The kernel's output and (dq, dk, dv) for a random cotangent, in one program,
    with the float64 inputs the references take."""
    B, T, H, K, D = shape
    rng = np.random.default_rng(seed)
    (q, q64), (k, k64), (v, v64), (w, w64) = (
        _exact(rng.normal(size=s), dtype) for s in ((B, T, H, D), (B, T, K, D), (B, T, K, D),
                                                    (B, T, H, D)))

    def fwd_bwd(q, k, v, w, seg):
        out, vjp = jax.vjp(lambda q, k, v: attention.causal_attention(
            q, k, v, impl, block=block, interpret=INTERPRET, segment_ids_BT=seg), q, k, v)
        return out, vjp(w)

    with _precision(dtype):
        out, grads = jax.jit(fwd_bwd)(q, k, v, w, segment_ids)
    assert out.dtype == jnp.dtype(dtype)
    want_out = _naive(q64, k64, v64, segment_ids)
    return out, grads, want_out, _attention_grads(q64, k64, v64, w64, segment_ids)


def _check_attention(record, name, out, grads, want_out, want_grads, **figures):
    _compare(record, f"{name} out", out, want_out, TOL[figures["dtype"]], **figures)
    for g, r, x in zip(grads, want_grads, "qkv"):
        _compare(record, f"{name} d{x}", g, r, TOL[figures["dtype"]], **figures)


@pytest.mark.parametrize("impl, dtype", _ATTENTION_CASES)
def test_causal_attention_and_gradients_match_numpy(record, impl, dtype):
    """Grouped-query heads (4 over 2); outside splash a length (37) that is not a
    multiple of the block (16). Splash's blocks are multiples of 128 and it does not
    pad, so it gets two whole blocks."""
    shape, block = ((1, 256, 4, 2, 128), 128) if impl == "splash" else ((2, 37, 4, 2, 16), 16)
    got = _run_attention(impl, dtype, shape, block)
    _check_attention(record, "causal", *got, impl=impl, dtype=dtype, T=shape[1], block=block)


@pytest.mark.parametrize("impl, dtype", [(i, "bfloat16" if i == "cudnn" else "float32")
                                         for i in ATTENTION])
def test_packed_rows_match_numpy(record, impl, dtype, caplog):
    """Several sequences per row with padding between them; each token sees only its
    own sequence (f32: a mask error shows above its tight bound). cudnn takes no
    segment ids: it must run them blockwise."""
    if impl == "splash":
        rows, shape, block = [[100, 60, -16, 80]], (1, 256, 4, 2, 128), 128
    else:
        rows, shape, block = PACKED_21, (2, 21, 4, 2, 16), 8
    seg = _segments(rows)
    with caplog.at_level("WARNING"):
        got = _run_attention(impl, dtype, shape, block, segment_ids=seg, seed=5)
    assert ("cannot take segment ids" in caplog.text) == (impl == "cudnn")
    _check_attention(record, "packed", *got, impl=impl, dtype=dtype, T=shape[1], block=block)


# ------------------------------------------------------------------ paged decode

def _paged_problem(dtype, in_place=False):
    """Slots of 23, 64, 1 and 40 positions in pages of 16: slot 1 maps slot 0's first
    page, slot 3 slot 1's first two (one of them slot 0's); in place, none shared."""
    B, H, K, D, ps = 4, 4, 2, 128, 16
    pool = PagePool(num_pages=14, page_size=ps, slots=B, max_tokens=64,
                    in_place="always" if in_place else "never")
    lengths = np.array([23, 64, 1, 40], np.int32)
    pool.assign(0, 23)
    pool.assign(1, 64, pool.share(0, 23))
    pool.assign(2, 1)
    pool.assign(3, 40, pool.share(1, 32))
    rng = np.random.default_rng(0)
    q, k, v = (_exact(rng.normal(size=s), dtype) for s in
               ((B, H, D), (K, 15, ps, D), (K, 15, ps, D)))
    tables = [list(pool.slot_pages(b)) for b in range(B)]
    assert (tables[3][:2] == tables[1][:2] and tables[1][0] == tables[0][0]) != in_place
    return q, k, v, lengths, jax.tree.map(jnp.asarray, pool.view()), tables


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("impl", PAGED)
def test_paged_decode_attention_matches_per_slot_softmax(record, impl, dtype):
    (q, q64), (k, k64), (v, v64), lengths, view, tables = _paged_problem(
        dtype, in_place=impl == "pool")
    fn = jax.jit(pa.paged_attention, static_argnames=("implementation", "interpret"))
    with _precision(dtype):
        got = fn(q, k, v, lengths, view, implementation=impl, interpret=None)
    assert got.dtype == jnp.dtype(dtype)
    want = rc.paged_attention_reference(q64, k64, v64, lengths, tables)
    # The TPU kernel reads pages as bf16; Triton's f32 dots take TF32 (10-bit mantissa).
    tol = TOL["bfloat16" if impl not in ("ragged", "pool") else dtype]
    _compare(record, "paged", got, want, tol, impl=impl, dtype=dtype,
             lengths=lengths.tolist())


# ------------------------------------------------------------------------- MoE

def _dense_moe(router, w_gate, w_up, w_down, x_ND, top_k):
    """The MoE layer as dense einsums: every expert on every token, weighted by the
    renormalised top-k router probabilities (zero for the others)."""
    probs_NE = jax.nn.softmax(x_ND.astype(jnp.float32) @ router, axis=-1)
    top_NK, experts_NK = jax.lax.top_k(probs_NE, top_k)
    top_NK = top_NK / top_NK.sum(-1, keepdims=True)
    combine_NE = jnp.einsum("nk,nke->ne", top_NK, jax.nn.one_hot(experts_NK, router.shape[1]))
    gate = jnp.einsum("nd,edf->nef", x_ND, w_gate)
    h = jax.nn.silu(gate) * jnp.einsum("nd,edf->nef", x_ND, w_up)
    return jnp.einsum("nef,efd,ne->nd", h, w_down, combine_NE)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dropless_moe_matches_numpy_and_dense_gradients(record, dtype):
    """ragged_dot dispatch against the token-by-token numpy reference; its gradients
    (input, router, experts) finite and equal to the dense formulation's (f32)."""
    cfg = dataclasses.replace(MOE_CFG, dtype=dtype)
    layer = nnx.eval_shape(lambda: moe.MoE(cfg, rngs=nnx.Rngs(params=0)))
    rng = np.random.default_rng(0)
    for w in (layer.router, layer.w_gate, layer.w_up, layer.w_down):
        # fan-in scaled, and values the kernel multiplies as they are (bf16-exact)
        w.set_value(jnp.asarray(w.shape[-2] ** -0.5 * rng.normal(size=w.shape), dtype)
                    .astype(jnp.float32))
    x, x64 = _exact(rng.normal(size=(2, 7, cfg.d_model)), dtype)
    cot = jnp.asarray(rng.normal(size=x.shape), dtype)
    graphdef, state = nnx.split(layer)
    names = ("router", "w_gate", "w_up", "w_down")

    def loss(state, x):
        y, _ = nnx.merge(graphdef, state)(x, dropless=True)
        return jnp.sum(y.astype(jnp.float32) * cot), y

    def dense(weights, x):
        y = _dense_moe(*weights, x.reshape(-1, cfg.d_model), cfg.moe.top_k)
        return jnp.sum(y * cot.astype(jnp.float32).reshape(y.shape))

    with _precision(dtype):
        (_, y), (g_state, g_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1),
                                                            has_aux=True))(state, x)
        want_w, want_x = jax.jit(jax.grad(dense, argnums=(0, 1)))(
            tuple(state[n][...] for n in names), x.astype(jnp.float32))
    assert y.dtype == jnp.dtype(dtype)
    ref = _reference_moe(layer, x64.reshape(-1, cfg.d_model), cfg.moe.top_k, True)
    _compare(record, "moe out", y.reshape(ref.shape), ref, TOL[dtype], dtype=dtype)
    got = [g_state[n][...] for n in names] + [g_x]
    for name, g, r in zip(names + ("x",), got, (*want_w, want_x)):
        assert np.isfinite(np.asarray(g, np.float32)).all(), name
        _compare(record, f"moe d{name}", g, r, TOL[dtype], dtype=dtype)


# ------------------------------------------- bf16 decode engine vs train forward

PROMPTS = [[5, 17, 9], [40, 2, 77, 31, 8], [3, 3, 3, 3, 3, 3, 3, 3], [99, 12, 64, 7]]
# |engine log-prob - trainer log-prob| of the sampled tokens, the model in bf16 (f32
# params): (bound, share of tokens allowed beyond it, hard max). bf16 roundings in
# different orders stay well within 0.1 (0.032 seen on CPU); in MoE a near-tie of
# two experts' router probabilities can pick another expert in one of the two
# computations, and that token moves by far more (0.45 seen on CPU).
LOGPROB_TOL = {"dense": (0.1, 0.0, 0.1), "moe": (0.1, 1 / 8, 2.0)}


def _numpy_params(model_cfg, seed=0):
    """Weights at the model's shapes from numpy (std d_model^-1/2, norm scales 1):
    nothing to compile, unlike the model's per-shape initialisers."""
    rng = np.random.default_rng(seed)
    std = model_cfg.d_model ** -0.5

    def leaf(path, x):
        if "scale" in jax.tree_util.keystr(path):
            return jnp.ones(x.shape, x.dtype)
        return jnp.asarray(std * rng.normal(size=x.shape), x.dtype)
    return jax.tree_util.tree_map_with_path(leaf, transformer.abstract_params(model_cfg)[1])


def _trainer_logprobs(cfg, graphdef, params, arrays, packed):
    """[rows, T] log-probs of a layout's micro-batches as the trainer computes them
    (Trainer._forward, then objective.sampled_logprobs)."""
    T = arrays["tokens"].shape[-1]
    tokens, seg, pos = (jnp.asarray(arrays[k]).reshape(-1, T)
                        for k in ("tokens", "segment_ids", "positions"))

    def logp(params, tokens, seg, pos):
        extra = dict(positions_BT=pos, segment_ids_BT=seg) if packed else {}
        logits, _, _ = transformer.apply(graphdef, params, tokens, valid_BT=seg > 0, **extra)
        return objective.sampled_logprobs(logits, tokens, cfg)

    return np.asarray(jax.jit(logp)(params, tokens, seg, pos))


@pytest.mark.parametrize("model", sorted(TINY))
def test_bf16_decode_logprobs_match_the_train_forward(record, model):
    """The paged-KV engine samples 8 tokens for each of 4 prompts in bf16; the
    trainer's forward of the same batch gives each sampled token the same log-prob
    within LOGPROB_TOL."""
    # The tiny model's 8-token prefill is below splash's 128-position blocks.
    tpu = {"model__attention": "blockwise"} if BACKEND == "tpu" else {}
    cfg = load_repo_config(TINY[model], num_devices=8, model__dtype="bfloat16",
                           rollout__slots_per_slice=4, rollout__max_prefill_length=8,
                           rollout__max_decode_len=8, rollout__prefill_buckets=(8,),
                           rollout__decode_steps=8, rollout__page_size=4, **tpu)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), config_lib.SLICE_MESH_AXES)
    sl = DecodeSlice.create(0, mesh, cfg.model, cfg.rollout, lookahead=False, stop_ids=())
    params = _numpy_params(cfg.model)
    sl.load_version(0, params)
    for i, prompt in enumerate(PROMPTS):
        sl.submit(Request(group_id=i, prompt_id=i, sample_index=0, prompt_tokens=prompt,
                          seed=100 + i, version=0))
    trajs = [dataclasses.replace(t, reward=0.0) for t in sl.drain()]
    assert sorted(len(t.response_tokens) for t in trajs) == [8] * 4
    # As the trainer lays a batch out: rows of the bucket (32), padded or two samples
    # per packed row; the packed layout only where its attention differs (GPU).
    batch = TrainBatch.from_trajectories(trajs, group_size=1,
                                         length_buckets=cfg.trainer.length_buckets)
    refusal = attention.cudnn_takes(cfg.model.dtype, cfg.model.head_dim)
    impls = {p: attention.resolve(cfg.model.attention, packed=p, cudnn_refusal=refusal)
             for p in (False, True)}
    layouts = {"padded": packing.padded(batch, 1, 1)}
    if impls[True] != impls[False]:
        layouts["packed"] = packing.packed(batch, 1, batch.length, 2)
        assert batch.length == 32 and layouts["packed"]["segment_ids"].max() == 2
    for layout, arrays in layouts.items():
        packed = layout == "packed"
        logp = _trainer_logprobs(cfg, transformer.abstract_params(cfg.model)[0], params, arrays,
                                 packed)
        mask = np.asarray(arrays["loss_mask"]).reshape(logp.shape) > 0
        assert mask.sum() == 32
        got, want = logp[mask], np.asarray(arrays["behaviour_logp"]).reshape(logp.shape)[mask]
        diff = np.abs(got - want)
        tol, share, hard = LOGPROB_TOL[model]
        record("logprob", max_abs_err=float(diff.max()), mean_abs_err=float(diff.mean()),
               tol=tol, over_tol=int((diff > tol).sum()), over_tol_allowed=share,
               hard_max=hard, model=model, layout=layout, dtype="bfloat16",
               attention=impls[packed], paged=pa.resolve(cfg.rollout.paged_attention),
               paged_in_place=sl.engine.pages.in_place,
               tokens=int(mask.sum()))
        assert np.mean(diff > tol) <= share and diff.max() <= hard, (layout, np.sort(diff))
        assert np.std(want) > 0.1  # sampled tokens of differing probability, not ~uniform
