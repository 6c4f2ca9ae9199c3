"""Causal self-attention over a whole sequence (training, scoring, prefill), by
implementation (`model.attention`):

- `dense`: the reference. Materialises the [B, heads, T, T] scores: memory grows
  with T².
- `blockwise`: flash-style attention in plain XLA. Queries and keys are cut into
  blocks; the forward keeps a running max and sum per query (online softmax) and
  saves only the output and its log-sum-exp; the backward (custom VJP) recomputes
  each block's probabilities. Memory is linear in T; runs on every backend.
- `cudnn`: `jax.nn.dot_product_attention`'s fused GPU kernel.
- `splash`: the TPU Pallas splash-attention kernel.

`auto` picks splash on TPU, cudnn on GPU, blockwise elsewhere. Shapes: queries
[B, T, H, D], keys/values [B, T, K, D] with H a multiple of K (grouped-query).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dora_jax.config import ATTENTION_IMPLS
from dora_jax.model.sharding import active_rules, logical_to_spec

NEG_INF = -1e30  # finite, so a fully masked row gives a uniform softmax, not NaN


def attend(q_BTHD, k_BSKD, v_BSKD, mask_BTS):
    """Dense grouped-query attention under an explicit mask (also the decode path)."""
    B, T, H, D = q_BTHD.shape
    K = k_BSKD.shape[2]
    q_BTKGD = q_BTHD.reshape(B, T, K, H // K, D)
    scores = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k_BSKD,
                        preferred_element_type=jnp.float32) * (D ** -0.5)
    scores = jnp.where(mask_BTS[:, None, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSKD.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_BSKD)
    return out.reshape(B, T, H, D)


def dense_causal(q_BTHD, k_BTKD, v_BTKD):
    B, T = q_BTHD.shape[:2]
    causal_TT = jnp.tril(jnp.ones((T, T), bool))
    return attend(q_BTHD, k_BTKD, v_BTKD, jnp.broadcast_to(causal_TT, (B, T, T)))


# ----------------------------------------------------------------------- blockwise
# Internal layout: q as [n_q, B, K, G, bq, D] blocks, k/v as [n_k, B, K, bk, D].

def _split_q(q_BTHD, K, bq):
    B, T, H, D = q_BTHD.shape
    q = q_BTHD.reshape(B, T // bq, bq, K, H // K, D)
    return q.transpose(1, 0, 3, 4, 2, 5)


def _merge_q(x, shape):
    B, T, H, D = shape
    return x.transpose(1, 0, 4, 2, 3, 5).reshape(B, T, H, D)


def _split_kv(k_BTKD, bk):
    B, T, K, D = k_BTKD.shape
    return k_BTKD.reshape(B, T // bk, bk, K, D).transpose(1, 0, 3, 2, 4)


def _merge_kv(x, shape):
    B, T, K, D = shape
    return x.transpose(1, 0, 3, 2, 4).reshape(B, T, K, D)


def _block_scores(q, k, i, j, bq, bk, scale):
    """Scores of query block i against key block j, f32, causally masked; and the mask."""
    s = jnp.einsum("bkgqd,bkcd->bkgqc", q, k, preferred_element_type=jnp.float32) * scale
    q_pos = i * bq + jnp.arange(bq)
    k_pos = j * bk + jnp.arange(bk)
    mask = k_pos[None, :] <= q_pos[:, None]
    return jnp.where(mask, s, NEG_INF), mask


def _forward(q_blocks, k_blocks, v_blocks, bq, bk, scale):
    """(out blocks, log-sum-exp blocks) by online softmax over key blocks."""

    def one_q_block(args):
        i, q = args

        def step(j, carry):
            o, m, l = carry
            s, mask = _block_scores(q, k_blocks[j], i, j, bq, bk, scale)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            corr = jnp.exp(m - m_new)
            o = o * corr[..., None] + jnp.einsum("bkgqc,bkcd->bkgqd", p, v_blocks[j],
                                                 preferred_element_type=jnp.float32)
            return o, m_new, l * corr + p.sum(-1)

        init = (jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:-1], NEG_INF, jnp.float32),
                jnp.zeros(q.shape[:-1], jnp.float32))
        # Causal: only key blocks that start at or before this block's last query.
        last = jnp.minimum((i * bq + bq - 1) // bk + 1, k_blocks.shape[0])
        o, m, l = jax.lax.fori_loop(0, last, step, init)
        return o / l[..., None], m + jnp.log(l)

    return jax.lax.map(one_q_block, (jnp.arange(q_blocks.shape[0]), q_blocks))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _flash(q_BTHD, k_BTKD, v_BTKD, bq, bk):
    out, _ = _flash_fwd(q_BTHD, k_BTKD, v_BTKD, bq, bk)
    return out


def _flash_fwd(q_BTHD, k_BTKD, v_BTKD, bq, bk):
    K, D = k_BTKD.shape[2], q_BTHD.shape[-1]
    q, k, v = _split_q(q_BTHD, K, bq), _split_kv(k_BTKD, bk), _split_kv(v_BTKD, bk)
    o, lse = _forward(q, k, v, bq, bk, D ** -0.5)
    out = _merge_q(o, q_BTHD.shape).astype(q_BTHD.dtype)
    return out, (q_BTHD, k_BTKD, v_BTKD, out, lse)


def _flash_bwd(bq, bk, residuals, d_out):
    """Recomputes each block's probabilities from the saved log-sum-exp; one pass
    over key blocks, each visiting the query blocks that can see it."""
    q_BTHD, k_BTKD, v_BTKD, out, lse = residuals
    K, D = k_BTKD.shape[2], q_BTHD.shape[-1]
    scale = D ** -0.5
    q, k, v = _split_q(q_BTHD, K, bq), _split_kv(k_BTKD, bk), _split_kv(v_BTKD, bk)
    do = _split_q(d_out, K, bq).astype(jnp.float32)
    # delta_i = sum_d dO_i * O_i: the softmax backward's row term.
    delta = jnp.sum(do * _split_q(out, K, bq).astype(jnp.float32), axis=-1)
    n_q, n_k = q.shape[0], k.shape[0]

    def one_k_block(j, dq):
        k_j, v_j = k[j].astype(jnp.float32), v[j].astype(jnp.float32)

        def step(i, carry):
            dk, dv, dq = carry
            s, mask = _block_scores(q[i], k[j], i, j, bq, bk, scale)
            p = jnp.where(mask, jnp.exp(s - lse[i][..., None]), 0.0)
            dv = dv + jnp.einsum("bkgqc,bkgqd->bkcd", p, do[i])
            dp = jnp.einsum("bkgqd,bkcd->bkgqc", do[i], v_j)
            ds = p * (dp - delta[i][..., None]) * scale
            dk = dk + jnp.einsum("bkgqc,bkgqd->bkcd", ds, q[i].astype(jnp.float32))
            dq = dq.at[i].add(jnp.einsum("bkgqc,bkcd->bkgqd", ds, k_j))
            return dk, dv, dq

        zeros = jnp.zeros(k_j.shape, jnp.float32)
        first = (j * bk) // bq  # the first query block that sees key block j
        dk, dv, dq = jax.lax.fori_loop(first, n_q, step, (zeros, zeros, dq))
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(lambda dq, j: one_k_block(j, dq),
                                jnp.zeros(q.shape, jnp.float32), jnp.arange(n_k))
    return (_merge_q(dq, q_BTHD.shape).astype(q_BTHD.dtype),
            _merge_kv(dk, k_BTKD.shape).astype(k_BTKD.dtype),
            _merge_kv(dv, v_BTKD.shape).astype(v_BTKD.dtype))


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise_causal(q_BTHD, k_BTKD, v_BTKD, block: int = 512):
    """Flash-style causal attention with blocks of `block` queries and keys; T is
    padded up to a multiple of the block (the padding is masked out causally)."""
    T = q_BTHD.shape[1]
    b = min(block, T)
    pad = -T % b
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q_BTHD, k_BTKD, v_BTKD = (jnp.pad(x, widths) for x in (q_BTHD, k_BTKD, v_BTKD))
    out = _flash(q_BTHD, k_BTKD, v_BTKD, b, b)
    return out[:, :T]


def cudnn_causal(q_BTHD, k_BTKD, v_BTKD):
    return jax.nn.dot_product_attention(q_BTHD, k_BTKD, v_BTKD, is_causal=True,
                                        implementation="cudnn")


def splash_causal(q_BTHD, k_BTKD, v_BTKD, block: int = 512, interpret: bool = False):
    """TPU Pallas splash attention: per KV head one multi-query kernel call over its
    group of query heads (heads-major layout; splash expects pre-scaled queries)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash, splash_attention_mask as masks)

    B, T, H, D = q_BTHD.shape
    K = k_BTKD.shape[2]
    b = min(block, T)
    sizes = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                              block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b,
                              block_kv_dq=b)
    kernel = splash.make_splash_mqa_single_device(
        masks.MultiHeadMask([masks.CausalMask((T, T)) for _ in range(H // K)]),
        block_sizes=sizes, interpret=interpret)
    q_BKGTD = (q_BTHD * D ** -0.5).reshape(B, T, K, H // K, D).transpose(0, 2, 3, 1, 4)
    k_BKTD, v_BKTD = k_BTKD.transpose(0, 2, 1, 3), v_BTKD.transpose(0, 2, 1, 3)
    out = jax.vmap(jax.vmap(kernel))(q_BKGTD, k_BKTD, v_BKTD)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)


def resolve(implementation: str, backend: str | None = None) -> str:
    """The implementation `auto` stands for on `backend` (default: JAX's)."""
    if implementation != "auto":
        return implementation
    backend = backend or jax.default_backend()
    return {"tpu": "splash", "gpu": "cudnn"}.get(backend, "blockwise")


def causal_attention(q_BTHD, k_BTKD, v_BTKD, implementation: str = "auto",
                     block: int = 512, interpret: bool = False):
    """Causal self-attention by `implementation` (see the module docstring).

    A Pallas kernel cannot be partitioned by XLA: inside `sharding.activation_rules`
    splash runs per shard under `shard_map` (batch and heads split by the rules;
    the sequence is never split). `interpret` runs it in Pallas' interpreter (CPU)."""
    impl = resolve(implementation)
    if impl == "dense":
        return dense_causal(q_BTHD, k_BTKD, v_BTKD)
    if impl == "blockwise":
        return blockwise_causal(q_BTHD, k_BTKD, v_BTKD, block)
    if impl == "cudnn":
        return cudnn_causal(q_BTHD, k_BTKD, v_BTKD)
    if impl == "splash":
        kernel = functools.partial(splash_causal, block=block, interpret=interpret)
        ctx = active_rules()
        if ctx is None:
            return kernel(q_BTHD, k_BTKD, v_BTKD)
        mesh, rules = ctx
        q_spec = logical_to_spec(("batch", "length", "heads", "head_dim"), rules, mesh)
        kv_spec = logical_to_spec(("batch", "length", "kv_heads", "head_dim"), rules, mesh)
        return jax.shard_map(kernel, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec),
                             out_specs=q_spec, check_vma=False)(q_BTHD, k_BTKD, v_BTKD)
    raise ValueError(f"unknown attention implementation {implementation!r}; "
                     f"known: {ATTENTION_IMPLS}")
