"""Decode attention over a paged KV cache (one new token per slot).

The pool of one layer is [kv_heads, pages, page_size, head_dim] (the TPU kernel's
layout); a slot's positions live in the pages its row of the page table names
(`rollout/pages.py`). Implementations (`rollout.paged_attention`):

- `ragged`: plain XLA, every backend. Every mapped page of every slot is gathered
  into one flat list (slot-major, padded to a bucket); each page is scored against
  its own slot's query and a softmax per slot is assembled from per-page maxima and
  sums (segment max / segment sum). Work and memory traffic follow the sum of the
  slots' real contexts, not slots x cache_length.
- `pallas`: the TPU Pallas paged-attention kernel (`jax.experimental.pallas.ops.tpu`);
- `pallas_gpu`: JAX's Pallas (Triton) paged-attention kernel for GPUs
  (`jax.experimental.pallas.ops.gpu`). Each slot's query block reads its own pages
  where they lie, split over the slot's pages and merged as flash-decoding does, where
  `ragged` gathers every mapped page into a copy first.

The kernels run per shard under `shard_map` when activation rules shard the KV heads,
and in Pallas' interpreter off their own backend (tests on a CPU). `auto` picks
pallas on TPU and ragged elsewhere: pallas_gpu is chosen by name until it has been
timed against ragged on a GPU (`bench.engine --paged_attention=ragged,pallas_gpu`).
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


def resolve(implementation: str, backend: str | None = None) -> str:
    """The implementation `auto` stands for on `backend` (default: JAX's)."""
    if implementation != "auto":
        return implementation
    return "pallas" if (backend or jax.default_backend()) == "tpu" else "ragged"


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
    impl = resolve(implementation)
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
