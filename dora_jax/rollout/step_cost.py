"""What a slice's compiled decode step costs next to its ideal: the bytes it accesses
and the kernels it launches, counted from its optimised HLO (hlo_cost.py), against
the weights read once plus the KV cache."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from dora_jax.rollout import hlo_cost

if TYPE_CHECKING:
    from dora_jax.rollout.engine import Engine
    from dora_jax.rollout.state import EngineParams


def _nbytes(arrays: Iterable[Any]) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in arrays)


def step_cost(engine: Engine, params: EngineParams) -> dict:
    """The one-token decode step (`generate`) of `params` on `engine`: `bytes_accessed`,
    and `ideal_bytes` = the weights read once plus the whole KV cache (a bound on the
    live KV; paged: the pool); `xla_bytes_accessed`, XLA's own cost analysis (which
    charges a loop's body once and an in-place scatter its whole buffer); the
    `kernels` one step launches, i.e. per token (both counts None where a loop's trip
    count is not static: a Pallas kernel interpreted); and `temp_bytes`, the step's
    scratch memory (a copy of the cache or of a weight would show here).
    Compiled for the page view as it stands; changes nothing. `params` may be
    abstract (ShapeDtypeStructs with the placement's shardings)."""
    compiled = engine.compiled_step(params)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    weights = _nbytes(params.leaves)
    state = compiled.args_info[0][1]  # the step's decode state, as it was compiled
    kv = _nbytes(jax.tree.leaves(state.cache))
    counted, kernels = hlo_cost.bounded_counts(compiled.as_text())
    return dict(bytes_accessed=counted,
                xla_bytes_accessed=float(cost["bytes accessed"]), flops=float(cost["flops"]),
                weight_bytes=weights, kv_bytes=kv, ideal_bytes=weights + kv, kernels=kernels,
                temp_bytes=compiled.memory_analysis().temp_size_in_bytes)
