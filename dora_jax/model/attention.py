"""Causal self-attention over a whole sequence (training, scoring, prefill), by
implementation (`model.attention`):

- `dense`: the reference. Materialises the [B, heads, T, T] scores: memory grows
  with T².
- `blockwise`: flash-style attention in plain XLA. Queries and keys are cut into
  blocks; the forward keeps a running max and sum per query (online softmax) and
  saves only the output and its log-sum-exp; the backward (custom VJP) recomputes
  each block's probabilities. Memory is linear in T; runs on every backend.
- `cudnn`: `jax.nn.dot_product_attention`'s fused GPU kernel (bf16/fp16 only, head
  dim a multiple of 8 up to 256; T padded to even, as its causal training kernel needs).
- `splash`: the TPU Pallas splash-attention kernel.

`auto` picks splash on TPU, cudnn on GPU where cudnn takes the shapes and dtype,
blockwise elsewhere. Shapes: queries
[B, T, H, D], keys/values [B, T, K, D] with H a multiple of K (grouped-query).

Packed rows: with `segment_ids_BT` (int [B, T]; several sequences concatenated in a
row, numbered 1, 2, ... and 0 for padding) a token attends only to tokens at or
before it with the same id. Every token still sees itself, so no row of the mask is
empty and padding (which sees only earlier padding) stays finite; no real token ever
sees padding or another sequence. Without segment ids every path is the plain causal
one, unchanged.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from dora_jax.config import ATTENTION_IMPLS
from dora_jax.model.sharding import active_rules, logical_to_spec

NEG_INF = -1e30  # finite, so a fully masked row gives a uniform softmax, not NaN

_log = logging.getLogger(__name__)


def attend(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array,
           mask_BTS: jax.Array) -> jax.Array:
    """Dense grouped-query attention under an explicit mask."""
    B, T, H, D = q_BTHD.shape
    K = k_BSKD.shape[2]
    q_BTKGD = q_BTHD.reshape(B, T, K, H // K, D)
    scores = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k_BSKD,
                        preferred_element_type=jnp.float32) * (D ** -0.5)
    scores = jnp.where(mask_BTS[:, None, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSKD.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_BSKD)
    return out.reshape(B, T, H, D)


def attend_cache(q_BHD: jax.Array, k_BKSD: jax.Array, v_BKSD: jax.Array,
                 lengths_B: jax.Array) -> jax.Array:
    """One query per row against its first `lengths_B` cached positions (decode). The
    cache is head-major, [B, kv_heads, S, head_dim], so that both products read it
    as it lies, with no transpose of the whole cache per step. The softmax is
    normalised after the second product, on [B, H, D] rather than on the scores (at a
    small head_dim the scores weigh a tenth of the cache)."""
    B, H, D = q_BHD.shape
    K, S = k_BKSD.shape[1:3]
    q_BKGD = q_BHD.reshape(B, K, H // K, D)
    scores_BKGS = jnp.einsum("bkgd,bksd->bkgs", q_BKGD, k_BKSD,
                             preferred_element_type=jnp.float32) * (D ** -0.5)
    mask_BS = jnp.arange(S)[None, :] < lengths_B[:, None]
    scores_BKGS = jnp.where(mask_BS[:, None, None], scores_BKGS, NEG_INF)
    e_BKGS = jnp.exp(scores_BKGS - jnp.max(scores_BKGS, axis=-1, keepdims=True))
    num_BKGD = jnp.einsum("bkgs,bksd->bkgd", e_BKGS.astype(v_BKSD.dtype), v_BKSD,
                          preferred_element_type=jnp.float32)
    out_BKGD = num_BKGD / jnp.sum(e_BKGS, axis=-1, keepdims=True)
    return out_BKGD.astype(v_BKSD.dtype).reshape(B, H, D)


def dense_causal(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array,
                 segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """The reference: causal attention under a materialised [B, T, T] mask, within
    each segment when `segment_ids_BT` is given."""
    B, T = q_BTHD.shape[:2]
    causal_TT = jnp.tril(jnp.ones((T, T), bool))
    mask_BTT = jnp.broadcast_to(causal_TT, (B, T, T))
    if segment_ids_BT is not None:
        mask_BTT = mask_BTT & (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])
    return attend(q_BTHD, k_BTKD, v_BTKD, mask_BTT)


# ----------------------------------------------------------------------- blockwise
# Internal layout: q as [n_q, B, K, G, bq, D] blocks, k/v as [n_k, B, K, bk, D],
# segment ids as [n, B, b] blocks (the same array cut once for queries, once for keys).

# A blockwise loop's carry: three arrays (output, max, sum; or dk, dv, dq).
_Carry3 = tuple[jax.Array, jax.Array, jax.Array]


def _split_q(q_BTHD: jax.Array, K: int, bq: int) -> jax.Array:
    B, T, H, D = q_BTHD.shape
    q = q_BTHD.reshape(B, T // bq, bq, K, H // K, D)
    return q.transpose(1, 0, 3, 4, 2, 5)


def _merge_q(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    B, T, H, D = shape
    return x.transpose(1, 0, 4, 2, 3, 5).reshape(B, T, H, D)


def _split_kv(k_BTKD: jax.Array, bk: int) -> jax.Array:
    B, T, K, D = k_BTKD.shape
    return k_BTKD.reshape(B, T // bk, bk, K, D).transpose(1, 0, 3, 2, 4)


def _merge_kv(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    B, T, K, D = shape
    return x.transpose(1, 0, 3, 2, 4).reshape(B, T, K, D)


def _split_segments(segment_ids_BT: jax.Array, b: int) -> jax.Array:
    B, T = segment_ids_BT.shape
    return segment_ids_BT.reshape(B, T // b, b).transpose(1, 0, 2)


def _block_scores(q: jax.Array, k: jax.Array, i: jax.Array, j: jax.Array, bq: int, bk: int,
                  scale: float, seg_q: jax.Array | None = None, seg_k: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array]:
    """Scores of query block i against key block j, f32, causally masked; and the mask.
    With the blocks' segment ids (seg_q [B, bq], seg_k [B, bk]) the mask also keeps
    each query to its own segment."""
    s = jnp.einsum("bkgqd,bkcd->bkgqc", q, k, preferred_element_type=jnp.float32) * scale
    q_pos = i * bq + jnp.arange(bq)
    k_pos = j * bk + jnp.arange(bk)
    mask = k_pos[None, :] <= q_pos[:, None]
    if seg_q is not None and seg_k is not None:
        same_BQC = seg_q[:, :, None] == seg_k[:, None, :]
        mask = (mask & same_BQC)[:, None, None]  # broadcast over kv heads and groups
    return jnp.where(mask, s, NEG_INF), mask


def _blocks_meet(seg_q: jax.Array, seg_k: jax.Array) -> jax.Array:
    """[n_q, n_k] bool: whether some row may have a query of block i and a key of
    block j in the same segment, i.e. their id ranges overlap. A pair that fails this
    in every row is fully masked and skipped (exact for any ids; tight when ids grow
    along the row, as packing numbers them). One table for all rows, computed once:
    with the batch sharded, a per-pair test would be a collective in the inner loop."""
    lo_q, hi_q = seg_q.min(-1), seg_q.max(-1)  # [n_q, B]
    lo_k, hi_k = seg_k.min(-1), seg_k.max(-1)  # [n_k, B]
    overlap_QKB = (lo_k[None] <= hi_q[:, None]) & (lo_q[:, None] <= hi_k[None])
    return jnp.any(overlap_QKB, axis=-1)


def _forward(q_blocks: jax.Array, k_blocks: jax.Array, v_blocks: jax.Array, bq: int, bk: int,
             scale: float, seg_q: jax.Array | None = None, seg_k: jax.Array | None = None
             ) -> tuple[jax.Array, jax.Array]:
    """(out blocks, log-sum-exp blocks) by online softmax over key blocks. With
    segment-id blocks (seg_q [n_q, B, bq], seg_k [n_k, B, bk]) attention stays within
    segments and key blocks no query of the block can see are skipped."""
    if seg_q is not None:
        meet_QK = _blocks_meet(seg_q, seg_k)

    def one_q_block(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        i, q = args

        def update(j: jax.Array, carry: _Carry3) -> _Carry3:
            o, m, denom = carry
            segs = () if seg_q is None or seg_k is None else (seg_q[i], seg_k[j])
            s, mask = _block_scores(q, k_blocks[j], i, j, bq, bk, scale, *segs)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            corr = jnp.exp(m - m_new)
            o = o * corr[..., None] + jnp.einsum("bkgqc,bkcd->bkgqd", p, v_blocks[j],
                                                 preferred_element_type=jnp.float32)
            return o, m_new, denom * corr + p.sum(-1)

        if seg_q is None:
            step = update
        else:
            def step(j: jax.Array, carry: _Carry3) -> _Carry3:
                # The diagonal block always meets (each query sees itself), so every
                # query's sum `denom` is positive.
                return jax.lax.cond(meet_QK[i, j], lambda c: update(j, c), lambda c: c,
                                    carry)

        init = (jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:-1], NEG_INF, jnp.float32),
                jnp.zeros(q.shape[:-1], jnp.float32))
        # Causal: only key blocks that start at or before this block's last query.
        last = jnp.minimum((i * bq + bq - 1) // bk + 1, k_blocks.shape[0])
        o, m, denom = jax.lax.fori_loop(0, last, step, init)
        return o / denom[..., None], m + jnp.log(denom)

    return jax.lax.map(one_q_block, (jnp.arange(q_blocks.shape[0]), q_blocks))


def _split_segment_blocks(segment_ids_BT: jax.Array | None, bq: int, bk: int
                          ) -> tuple[()] | tuple[jax.Array, jax.Array]:
    """(query blocks, key blocks) of the segment ids; () without them."""
    if segment_ids_BT is None:
        return ()
    return _split_segments(segment_ids_BT, bq), _split_segments(segment_ids_BT, bk)


# segment_ids_BT is a primal (an array may not be a nondiff argument); it is integer,
# so its cotangent is None.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array,
           segment_ids_BT: jax.Array | None, bq: int, bk: int) -> jax.Array:
    out, _ = _flash_fwd(q_BTHD, k_BTKD, v_BTKD, segment_ids_BT, bq, bk)
    return out


def _flash_fwd(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array,
               segment_ids_BT: jax.Array | None, bq: int, bk: int
               ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    K, D = k_BTKD.shape[2], q_BTHD.shape[-1]
    q, k, v = _split_q(q_BTHD, K, bq), _split_kv(k_BTKD, bk), _split_kv(v_BTKD, bk)
    o, lse = _forward(q, k, v, bq, bk, D ** -0.5,
                      *_split_segment_blocks(segment_ids_BT, bq, bk))
    out = _merge_q(o, q_BTHD.shape).astype(q_BTHD.dtype)
    return out, (q_BTHD, k_BTKD, v_BTKD, segment_ids_BT, out, lse)


def _flash_bwd(bq: int, bk: int, residuals: tuple[jax.Array, ...], d_out: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array, None]:
    """Recomputes each block's probabilities from the saved log-sum-exp; one pass
    over key blocks, each visiting the query blocks that can see it (with segment
    ids, only those whose segments meet it)."""
    q_BTHD, k_BTKD, v_BTKD, segment_ids_BT, out, lse = residuals
    K, D = k_BTKD.shape[2], q_BTHD.shape[-1]
    scale = D ** -0.5
    q, k, v = _split_q(q_BTHD, K, bq), _split_kv(k_BTKD, bk), _split_kv(v_BTKD, bk)
    seg_blocks = _split_segment_blocks(segment_ids_BT, bq, bk)
    if seg_blocks:
        meet_QK = _blocks_meet(*seg_blocks)
    do = _split_q(d_out, K, bq).astype(jnp.float32)
    # delta_i = sum_d dO_i * O_i: the softmax backward's row term.
    delta = jnp.sum(do * _split_q(out, K, bq).astype(jnp.float32), axis=-1)
    n_q, n_k = q.shape[0], k.shape[0]

    def one_k_block(j: jax.Array, dq: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        k_j, v_j = k[j].astype(jnp.float32), v[j].astype(jnp.float32)

        def update(i: jax.Array, carry: _Carry3) -> _Carry3:
            dk, dv, dq = carry
            segs = () if not seg_blocks else (seg_blocks[0][i], seg_blocks[1][j])
            s, mask = _block_scores(q[i], k[j], i, j, bq, bk, scale, *segs)
            p = jnp.where(mask, jnp.exp(s - lse[i][..., None]), 0.0)
            dv = dv + jnp.einsum("bkgqc,bkgqd->bkcd", p, do[i])
            dp = jnp.einsum("bkgqd,bkcd->bkgqc", do[i], v_j)
            ds = p * (dp - delta[i][..., None]) * scale
            dk = dk + jnp.einsum("bkgqc,bkgqd->bkcd", ds, q[i].astype(jnp.float32))
            dq = dq.at[i].add(jnp.einsum("bkgqc,bkcd->bkgqd", ds, k_j))
            return dk, dv, dq

        if not seg_blocks:
            step = update
        else:
            def step(i: jax.Array, carry: _Carry3) -> _Carry3:
                return jax.lax.cond(meet_QK[i, j], lambda c: update(i, c), lambda c: c,
                                    carry)

        zeros = jnp.zeros(k_j.shape, jnp.float32)
        first = (j * bk) // bq  # the first query block that sees key block j
        dk, dv, dq = jax.lax.fori_loop(first, n_q, step, (zeros, zeros, dq))
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(lambda dq, j: one_k_block(j, dq),
                                jnp.zeros(q.shape, jnp.float32), jnp.arange(n_k))
    return (_merge_q(dq, q_BTHD.shape).astype(q_BTHD.dtype),
            _merge_kv(dk, k_BTKD.shape).astype(k_BTKD.dtype),
            _merge_kv(dv, v_BTKD.shape).astype(v_BTKD.dtype), None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise_causal(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array, block: int = 512,
                     segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """Flash-style causal attention with blocks of `block` queries and keys; T is
    padded up to a multiple of the block (the padding is masked out causally: it
    comes after every real query). With `segment_ids_BT`, within segments, and
    block pairs whose segments never meet are skipped."""
    T = q_BTHD.shape[1]
    b = min(block, T)
    pad = -T % b
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q_BTHD, k_BTKD, v_BTKD = (jnp.pad(x, widths) for x in (q_BTHD, k_BTKD, v_BTKD))
        if segment_ids_BT is not None:
            segment_ids_BT = jnp.pad(segment_ids_BT, ((0, 0), (0, pad)))
    out = _flash(q_BTHD, k_BTKD, v_BTKD, segment_ids_BT, b, b)
    return out[:, :T]


def cudnn_causal(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array) -> jax.Array:
    """cudnn's causal kernel refuses an odd length when it computes gradients; padding
    at the end is exact (the padding comes after every real query)."""
    T = q_BTHD.shape[1]
    if T % 2:
        widths = ((0, 0), (0, 1), (0, 0), (0, 0))
        q_BTHD, k_BTKD, v_BTKD = (jnp.pad(x, widths) for x in (q_BTHD, k_BTKD, v_BTKD))
    out = jax.nn.dot_product_attention(q_BTHD, k_BTKD, v_BTKD, is_causal=True,
                                       implementation="cudnn")
    return out[:, :T]


def cudnn_takes(dtype: jax.typing.DTypeLike, head_dim: int) -> str | None:
    """Why cudnn's fused kernel cannot run these inputs, or None when it can."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"it computes in bfloat16 or float16, not {jnp.dtype(dtype).name}"
    if head_dim % 8 or head_dim > 256:
        return f"its head dim must be a multiple of 8 up to 256, not {head_dim}"
    return None


def splash_causal(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array, block: int = 512,
                  interpret: bool = False, segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """TPU Pallas splash attention: per KV head one multi-query kernel call over its
    group of query heads (heads-major layout; splash expects pre-scaled queries).
    Segment ids go to the kernel as its `SegmentIds` (the same ids for queries and
    keys), and-ed with the causal mask inside each block; the block-sparse skipping
    comes from the static causal mask alone."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

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
    if segment_ids_BT is None:
        out = jax.vmap(jax.vmap(kernel))(q_BKGTD, k_BKTD, v_BKTD)
    else:
        def one_head(q_GTD: jax.Array, k_TD: jax.Array, v_TD: jax.Array, seg_T: jax.Array
                     ) -> jax.Array:
            return kernel(q_GTD, k_TD, v_TD, segment_ids=splash.SegmentIds(q=seg_T, kv=seg_T))

        # Over rows, then over kv heads (the row's ids shared by its heads).
        out = jax.vmap(jax.vmap(one_head, in_axes=(0, 0, 0, None)))(
            q_BKGTD, k_BKTD, v_BKTD, segment_ids_BT.astype(jnp.int32))
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)


def resolve(implementation: str, backend: str | None = None, packed: bool = False,
            cudnn_refusal: str | None = None) -> str:
    """The implementation `auto` stands for on `backend` (default: JAX's); `packed`
    (rows with segment ids) or a `cudnn_refusal` (`cudnn_takes`) gives GPU blockwise
    (see `causal_attention`)."""
    if implementation != "auto":
        return implementation
    backend = backend or jax.default_backend()
    gpu = "blockwise" if packed or cudnn_refusal else "cudnn"
    return {"tpu": "splash", "gpu": gpu}.get(backend, "blockwise")


def causal_attention(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array,
                     implementation: str = "auto", block: int = 512, interpret: bool = False,
                     segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """Causal self-attention by `implementation` (see the module docstring); with
    `segment_ids_BT` (int [B, T], 0 padding) within each packed sequence.

    A Pallas kernel cannot be partitioned by XLA: inside `sharding.activation_rules`
    splash runs per shard under `shard_map` (batch and heads split by the rules;
    the sequence is never split). `interpret` runs it in Pallas' interpreter (CPU).

    cudnn takes no segment ids: `jax.nn.dot_product_attention` (JAX 0.10) accepts
    per-row lengths, which describe one sequence per row, or a dense mask, which it
    turns into a [B, heads, T, T] bias, the quadratic memory a long packed row
    cannot afford. Packed rows on `cudnn` therefore run blockwise (linear memory,
    exact), with a warning; `auto` picks blockwise for them on GPU directly. So do
    inputs cudnn refuses (float32, an unaligned head dim)."""
    packed = segment_ids_BT is not None
    refusal = cudnn_takes(q_BTHD.dtype, q_BTHD.shape[-1])
    impl = resolve(implementation, packed=packed, cudnn_refusal=refusal)
    if impl == "cudnn" and (packed or refusal):
        why = "it cannot take segment ids (packed rows)" if packed else refusal
        _log.warning("model.attention=cudnn: %s; running blockwise attention instead", why)
        impl = "blockwise"
    if impl == "dense":
        return dense_causal(q_BTHD, k_BTKD, v_BTKD, segment_ids_BT)
    if impl == "blockwise":
        return blockwise_causal(q_BTHD, k_BTKD, v_BTKD, block, segment_ids_BT)
    if impl == "cudnn":
        return cudnn_causal(q_BTHD, k_BTKD, v_BTKD)
    if impl == "splash":
        kernel = functools.partial(splash_causal, block=block, interpret=interpret)
        args: tuple[jax.Array, ...] = (q_BTHD, k_BTKD, v_BTKD)
        if packed:
            kernel = functools.partial(_splash_packed, kernel)
            args += (segment_ids_BT,)
        ctx = active_rules()
        if ctx is None:
            return kernel(*args)
        mesh, rules = ctx
        q_spec = logical_to_spec(("batch", "length", "heads", "head_dim"), rules, mesh)
        kv_spec = logical_to_spec(("batch", "length", "kv_heads", "head_dim"), rules, mesh)
        specs: tuple[PartitionSpec, ...] = (q_spec, kv_spec, kv_spec)
        if packed:
            specs += (logical_to_spec(("batch", "length"), rules, mesh),)
        return jax.shard_map(kernel, mesh=mesh, in_specs=specs,
                             out_specs=q_spec, check_vma=False)(*args)
    raise ValueError(f"unknown attention implementation {implementation!r}; "
                     f"known: {ATTENTION_IMPLS}")


def _splash_packed(kernel: Callable[..., jax.Array], q_BTHD: jax.Array, k_BTKD: jax.Array,
                   v_BTKD: jax.Array, segment_ids_BT: jax.Array) -> jax.Array:
    # Positional segment ids, so that shard_map can split them with the batch.
    return kernel(q_BTHD, k_BTKD, v_BTKD, segment_ids_BT=segment_ids_BT)
