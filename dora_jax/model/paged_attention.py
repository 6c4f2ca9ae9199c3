"""Decode attention over a paged KV cache (one new token per slot).

The pool of one layer is [kv_heads, pages, page_size, head_dim] (the TPU kernel's
layout); a slot's positions live in the pages its row of the page table names
(`rollout/pages.py`). Implementations (`rollout.paged_attention`):

- `pool`: plain XLA, every backend. Every page of the pool is read where it lies,
  scored against the query of the one slot that maps it (pages are then not shared
  between slots: `rollout.pages.PagePool(in_place=...)`); a softmax per slot is
  assembled from its pages' maxima and sums, taken through its page table. A step
  reads the pool once, as a dense cache of the same size would be read, and
  compiles once whatever the number of mapped pages.
- `ragged`: plain XLA, every backend. Every mapped page of every slot is gathered
  into one flat list (slot-major, padded to a bucket), scored against its slot's
  query, and a softmax per slot is assembled from per-page maxima and sums (segment
  max / segment sum). Work follows the slots' real contexts, not the pool's size,
  but the gather writes a copy of the mapped pages that the products read again
  (about three times their bytes), and each bucket compiles its own step.
- `pallas`: the TPU Pallas paged-attention kernel (`jax.experimental.pallas.ops.tpu`);
- `pallas_gpu`: JAX's Pallas (Triton) paged-attention kernel for GPUs
  (`jax.experimental.pallas.ops.gpu`). Each slot's query block reads its own pages
  where they lie, split over the slot's pages and merged as flash-decoding does, where
  `ragged` gathers every mapped page into a copy first.

The kernels run per shard under `shard_map` when activation rules shard the KV heads,
and in Pallas' interpreter off their own backend (tests on a CPU). `auto` picks
pallas on TPU. Elsewhere it picks ragged, except that with a pool as large as a
dense cache (`rollout.kv_pages=0`, the default: every slot holds its whole length
without sharing pages) a step whose mapped pages need the largest bucket reads the
pool in place (pool) instead: from there up the gather's copy costs more than the
unmapped pages it skips (`in_place_views`). pallas_gpu is chosen by name until it
has been timed on a GPU (`bench.engine --paged_attention=ragged,pallas_gpu`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp

from dora_jax.config import PAGED_ATTENTION_IMPLS, gpu_paged_blocks
from dora_jax.model.attention import NEG_INF
from dora_jax.model.sharding import active_rules, logical_to_spec

# One layer's pool (a decode state holds one per layer: transformer.LayerCaches).
POOL_AXES = ("kv_heads", "pages", "page", "head_dim")


class PageView(Protocol):
    """What paged decode attention reads of one decode call's page view: the fields
    of `rollout.pages.PageView` (device arrays inside the jitted step), named here so
    that the model imports nothing of the rollout layer above it."""

    @property
    def table(self) -> jax.Array: ...  # int32[S, pages_per_slot]
    @property
    def owned(self) -> jax.Array: ...  # bool[S]
    @property
    def flat_pages(self) -> jax.Array: ...  # int32[N]
    @property
    def flat_slots(self) -> jax.Array: ...  # int32[N]
    @property
    def flat_starts(self) -> jax.Array: ...  # int32[N]
    @property
    def page_slots(self) -> jax.Array: ...  # int32[pages + 1] (in place), else [0]
    @property
    def page_starts(self) -> jax.Array: ...  # int32[pages + 1] (in place), else [0]


def resolve(implementation: str, backend: str | None = None, in_place: bool = False) -> str:
    """The implementation `auto` stands for on `backend` (default: JAX's), for a page
    view in place or not (`pages.PageView`)."""
    if implementation != "auto":
        return implementation
    if (backend or jax.default_backend()) == "tpu":
        return "pallas"
    return "pool" if in_place else "ragged"


def in_place_views(implementation: str, pool_is_dense: bool, backend: str | None = None
                   ) -> str:
    """When the page views of a pool are in place (`pages.PagePool`'s `in_place`) for
    `implementation`; pool_is_dense: the pool holds every slot's whole length."""
    if implementation == "pool":
        return "always"
    if implementation == "auto" and resolve("auto", backend) == "ragged" and pool_is_dense:
        return "full"
    return "never"


def pool_paged_attention(q_BHD: jax.Array, k_KPpD: jax.Array, v_KPpD: jax.Array,
                         lengths_B: jax.Array, table_BJ: jax.Array, page_slots_P: jax.Array,
                         page_starts_P: jax.Array) -> jax.Array:
    """Attention of each slot's query over its first `lengths_B[b]` positions, every
    page of the pool read in place: page p holds positions page_starts_P[p]... of
    slot page_slots_P[p] (B: of none), and a slot's pages are its row of `table_BJ`,
    the null page 0 where unmapped (see `pages.PageView`). Each page is scored
    against its slot's query kv-head major, so that both products read the pool as
    it lies; a slot's softmax is assembled from its pages' maxima and sums, which
    the null page, scored against no slot, leaves alone. A slot with no page gets
    zeros."""
    B, H, D = q_BHD.shape
    K, P, ps, _ = k_KPpD.shape
    q_ext = jnp.concatenate([q_BHD, jnp.zeros((1, H, D), q_BHD.dtype)])
    len_ext = jnp.concatenate([lengths_B, jnp.zeros(1, lengths_B.dtype)])
    q_KPGD = jnp.moveaxis(q_ext[page_slots_P].reshape(P, K, H // K, D), 1, 0)
    s_KPGp = jnp.einsum("kngd,knpd->kngp", q_KPGD, k_KPpD.astype(q_BHD.dtype),
                        preferred_element_type=jnp.float32) * (D ** -0.5)
    mask_Pp = page_starts_P[:, None] + jnp.arange(ps) < len_ext[page_slots_P][:, None]
    s_KPGp = jnp.where(mask_Pp[None, :, None], s_KPGp, NEG_INF)
    m_KBG = jnp.max(jnp.max(s_KPGp, axis=-1)[:, table_BJ], axis=2)
    m_KBG = jnp.concatenate([m_KBG, jnp.zeros_like(m_KBG[:, :1])], axis=1)  # slot B: none
    e_KPGp = jnp.exp(s_KPGp - m_KBG[:, page_slots_P][..., None]) * mask_Pp[None, :, None]
    den_KBG = jnp.sum(jnp.sum(e_KPGp, axis=-1)[:, table_BJ], axis=2)
    num_KPGD = jnp.einsum("kngp,knpd->kngd", e_KPGp.astype(v_KPpD.dtype), v_KPpD,
                          preferred_element_type=jnp.float32)
    num_KBGD = jnp.sum(num_KPGD[:, table_BJ], axis=2)
    out_KBGD = num_KBGD / jnp.maximum(den_KBG, 1e-30)[..., None]
    return jnp.moveaxis(out_KBGD, 0, 1).reshape(B, H, D).astype(q_BHD.dtype)


def ragged_paged_attention(q_BHD: jax.Array, k_KPpD: jax.Array, v_KPpD: jax.Array,
                           lengths_B: jax.Array, flat_pages_N: jax.Array, flat_slots_N: jax.Array,
                           flat_starts_N: jax.Array) -> jax.Array:
    """Attention of each slot's query over its first `lengths_B[b]` positions.

    flat_*: the mapped pages (see `pages.PageView`): page id, owning slot (B for
    padding, sorted ascending) and the slot position of the page's first entry.
    A slot with no page gets zeros.
    """
    B, H, D = q_BHD.shape
    K, _, ps, _ = k_KPpD.shape
    N = flat_pages_N.shape[0]
    q_ext = jnp.concatenate([q_BHD, jnp.zeros((1, H, D), q_BHD.dtype)])
    len_ext = jnp.concatenate([lengths_B, jnp.zeros(1, lengths_B.dtype)])
    q_NKGD = q_ext[flat_slots_N].reshape(N, K, H // K, D)
    k_KNpD, v_KNpD = k_KPpD[:, flat_pages_N], v_KPpD[:, flat_pages_N]
    s_NKGp = jnp.einsum("nkgd,knpd->nkgp", q_NKGD, k_KNpD.astype(q_BHD.dtype),
                        preferred_element_type=jnp.float32) * (D ** -0.5)
    pos_Np = flat_starts_N[:, None] + jnp.arange(ps)
    mask_Np = pos_Np < len_ext[flat_slots_N][:, None]
    s_NKGp = jnp.where(mask_Np[:, None, None], s_NKGp, NEG_INF)

    def per_slot(op: Callable[..., jax.Array], x: jax.Array) -> jax.Array:
        return op(x, flat_slots_N, num_segments=B + 1, indices_are_sorted=True)

    m_BKG = per_slot(jax.ops.segment_max, jnp.max(s_NKGp, axis=-1))
    e_NKGp = jnp.exp(s_NKGp - m_BKG[flat_slots_N][..., None]) * mask_Np[:, None, None]
    den_BKG = per_slot(jax.ops.segment_sum, jnp.sum(e_NKGp, axis=-1))
    num_NKGD = jnp.einsum("nkgp,knpd->nkgd", e_NKGp.astype(v_KPpD.dtype), v_KNpD,
                          preferred_element_type=jnp.float32)
    num_BKGD = per_slot(jax.ops.segment_sum, num_NKGD)
    out = num_BKGD[:B] / jnp.maximum(den_BKG[:B], 1e-30)[..., None]
    return out.reshape(B, H, D).astype(q_BHD.dtype)


def pallas_paged_attention(q_BHD: jax.Array, k_KPpD: jax.Array, v_KPpD: jax.Array,
                           lengths_B: jax.Array, table_BP: jax.Array,
                           interpret: bool = False) -> jax.Array:
    """The TPU kernel (it expects pre-scaled queries); `interpret` runs it in Pallas'
    TPU interpreter on any backend (tests)."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    D, pages_per_slot = q_BHD.shape[-1], table_BP.shape[1]
    block = max(b for b in (1, 2, 4, 8) if pages_per_slot % b == 0)
    ctx = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
    with ctx:
        out = paged_attention((q_BHD * D ** -0.5).astype(k_KPpD.dtype), k_KPpD, v_KPpD,
                              lengths_B, table_BP, pages_per_compute_block=block)
    return out.astype(q_BHD.dtype)


def pallas_gpu_paged_attention(q_BHD: jax.Array, k_KPpD: jax.Array, v_KPpD: jax.Array,
                               lengths_B: jax.Array, table_BP: jax.Array,
                               interpret: bool = False) -> jax.Array:
    """JAX's GPU kernel (it expects pre-scaled queries; a slot of length 0 gets
    zeros); `interpret` runs it in Pallas' interpreter on any backend."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    D = q_BHD.shape[-1]
    k_splits, block = gpu_paged_blocks(table_BP.shape[1], k_KPpD.shape[2], D)
    out = paged_attention((q_BHD * D ** -0.5).astype(k_KPpD.dtype), k_KPpD, v_KPpD,
                          table_BP, lengths_B.astype(jnp.int32), k_splits=k_splits,
                          pages_per_compute_block=block, interpret=interpret)
    return out.astype(q_BHD.dtype)


KERNELS = {"pallas": (pallas_paged_attention, "tpu"),
           "pallas_gpu": (pallas_gpu_paged_attention, "gpu")}


def paged_attention(q_BHD: jax.Array, k_KPpD: jax.Array, v_KPpD: jax.Array, lengths_B: jax.Array,
                    view: PageView, implementation: str = "auto",
                    interpret: bool | None = None) -> jax.Array:
    """Decode attention by `implementation`; `view` is a `pages.PageView` of arrays.
    interpret: run a Pallas kernel in the interpreter (None: off its own backend)."""
    in_place = view.page_slots.shape[0] > 0
    impl = resolve(implementation, in_place=in_place)
    if (impl == "pool" and not in_place) or (impl == "ragged" and in_place):
        raise ValueError(f"paged attention {impl!r} on a page view "
                         f"{'in' if in_place else 'not in'} place: 'pool' reads the views "
                         f"in place (PagePool's in_place), 'ragged' the others")
    if impl == "pool":
        return pool_paged_attention(q_BHD, k_KPpD, v_KPpD, lengths_B, view.table,
                                    view.page_slots, view.page_starts)
    if impl == "ragged":
        return ragged_paged_attention(q_BHD, k_KPpD, v_KPpD, lengths_B, view.flat_pages,
                                      view.flat_slots, view.flat_starts)
    if impl not in KERNELS:
        raise ValueError(f"unknown paged attention implementation {implementation!r}; "
                         f"known: {PAGED_ATTENTION_IMPLS}")
    fn, platform = KERNELS[impl]
    if interpret is None:
        interpret = jax.default_backend() != platform
    kernel = functools.partial(fn, interpret=interpret)
    ctx = active_rules()
    if ctx is None:
        return kernel(q_BHD, k_KPpD, v_KPpD, lengths_B, view.table)
    mesh, rules = ctx  # a Pallas kernel is not partitioned by XLA: run it per shard
    q_spec = logical_to_spec(("batch", "heads", "head_dim"), rules, mesh)
    kv_spec = logical_to_spec(POOL_AXES, rules, mesh)
    len_spec = logical_to_spec(("batch",), rules, mesh)
    table_spec = logical_to_spec(("batch", None), rules, mesh)
    return jax.shard_map(kernel, mesh=mesh,
                         in_specs=(q_spec, kv_spec, kv_spec, len_spec, table_spec),
                         out_specs=q_spec, check_vma=False)(
        q_BHD, k_KPpD, v_KPpD, lengths_B, view.table)
