"""Several LoRA versions resident on one engine: one base, V places of adapters.

A multi-version engine (`Engine(versions=V)`) takes params in the decode layout (one
array per layer: model/layer_layout.py) whose adapter leaves hold V adapter sets
stacked on a leading "place" axis and whose base leaves are the frozen base, once.
`AdapterPlaces` builds that tree and writes one version's adapters into a place, on
device, without touching the others: a version loads while slots of the other places
keep decoding, and a place is reused once its version is evicted. `with_rows` gives
the params a generate or prefill call takes, each batch row naming its place
(model/lora.py's `rows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from dora_jax.model import lora
from dora_jax.rollout.state import EngineParams

if TYPE_CHECKING:
    from dora_jax.config import ModelConfig
    from dora_jax.rollout.placement import ParamPlacement


def check_versions(model_cfg: ModelConfig, versions: int) -> None:
    """Several versions per engine need LoRA, and (for now) no per-expert adapters."""
    if versions < 1:
        raise ValueError(f"versions must be >= 1, got {versions}")
    if versions == 1:
        return
    if not model_cfg.lora.enabled:
        raise ValueError("model.lora.rank: several versions per slice share one base and "
                         "differ by their adapters: set model.lora.rank > 0 (full-weight "
                         "copies per slice are not supported)")
    if model_cfg.lora.experts and model_cfg.moe.num_experts:
        raise ValueError("model.lora.experts: per-expert adapters cannot be selected per "
                         "slot yet; several versions per slice need model.lora.experts=False")


class AdapterPlaces:
    """Which leaves are adapters, their stacked shapes and shardings, and the
    programs that fill a place."""

    def __init__(self, placement: ParamPlacement, versions: int) -> None:
        self.versions, self.axis = versions, 0
        paths = jax.tree_util.tree_leaves_with_path(
            jax.tree.unflatten(placement.treedef, list(placement.shardings.leaves)))
        self.is_adapter = tuple(lora._is_adapter(p) for p, _ in paths)
        single = placement.shardings.leaves
        self.shapes = tuple(
            (_stacked(shape, versions, self.axis) if ad else shape, dtype)
            for (shape, dtype), ad in zip(placement.leaf_shapes, self.is_adapter))
        self.shardings = EngineParams(
            tuple(_stacked_sharding(sh, self.axis) if ad else sh
                  for sh, ad in zip(single, self.is_adapter)),
            NamedSharding(single[0].mesh, PartitionSpec()))
        self._adapter_idx = tuple(i for i, ad in enumerate(self.is_adapter) if ad)
        # Only the adapter stacks are donated: the base leaves are shared with the
        # placement's cache of the frozen base (and with the placed version).
        self._write = jax.jit(self._write_fn, donate_argnums=(0,), out_shardings=tuple(
            self.shardings.leaves[i] for i in self._adapter_idx))

    def empty(self, base: EngineParams) -> EngineParams:
        """A stack holding `base`'s base leaves and zero adapters in every place."""
        leaves = []
        for x, ad, (shape, dtype), sh in zip(base.leaves, self.is_adapter, self.shapes,
                                             self.shardings.leaves):
            leaves.append(jax.device_put(jnp.zeros(shape, dtype), sh) if ad else x)
        return EngineParams(tuple(leaves))

    def put(self, stack: EngineParams, place: int, placed: EngineParams) -> EngineParams:
        """`stack` with place `place` holding the adapters of `placed` (one version's
        params, placed on this engine). Donates `stack`'s adapters."""
        if not 0 <= place < self.versions:
            raise ValueError(f"place {place} outside [0, {self.versions})")
        idx = self._adapter_idx
        new = self._write(tuple(stack.leaves[i] for i in idx),
                          tuple(placed.leaves[i] for i in idx), np.int32(place))
        leaves = list(stack.leaves)
        for i, x in zip(idx, new):
            leaves[i] = x
        return EngineParams(tuple(leaves))

    def _write_fn(self, stacked: tuple[jax.Array, ...], single: tuple[jax.Array, ...],
                  place: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(jax.lax.dynamic_update_index_in_dim(s, x.astype(s.dtype), place, self.axis)
                     for s, x in zip(stacked, single))

    def with_rows(self, stack: EngineParams, place_B: Sequence[int] | np.ndarray
                  ) -> EngineParams:
        """The params of a call whose row b decodes under place place_B[b]."""
        return EngineParams(stack.leaves, jnp.asarray(np.asarray(place_B, np.int32)))


def _stacked(shape: tuple[int, ...], versions: int, axis: int) -> tuple[int, ...]:
    return (*shape[:axis], versions, *shape[axis:])


def _stacked_sharding(sh: NamedSharding, axis: int) -> NamedSharding:
    spec = tuple(sh.spec) + (None,) * max(0, axis - len(sh.spec))
    return NamedSharding(sh.mesh, PartitionSpec(*spec[:axis], None, *spec[axis:]))
