"""Logical axis names -> mesh axes.

Model code names the axes of every param and activation logically
(`("embed", "mlp")`, `("batch", "length", "embed")`); a rule set (from the config)
maps each logical name to mesh axes. The trainer mesh and the decode-slice meshes use
the same model code with different rule sets.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]


def logical_to_spec(names: Iterable[str | None], rules: Rules,
                    mesh: Mesh | None = None) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec.

    A mesh axis shards at most one dimension: if two logical names map to the same
    mesh axis, the later dimension stays replicated. Mesh axes of size 1 are dropped
    when `mesh` is given, so specs stay readable and divisibility is not demanded of
    axes that do not split anything.
    """
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name in names:
        target = table.get(name) if name is not None else None
        axes = () if target is None else ((target,) if isinstance(target, str) else target)
        if mesh is not None:
            axes = tuple(a for a in axes if mesh.shape[a] > 1)
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        spec.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
    return PartitionSpec(*spec)


def is_variable(x: object) -> bool:
    """A leaf test for trees of nnx Variables (params with their metadata)."""
    return isinstance(x, nnx.Variable)


def param_specs(state: nnx.State, rules: Rules, mesh: Mesh | None = None) -> nnx.State:
    """PartitionSpec pytree (a prefix of `state`) from each Param's `logical_axes`."""

    def spec(v: nnx.Variable) -> PartitionSpec:
        axes = v.get_metadata().get("logical_axes")
        if axes is None:
            return PartitionSpec()
        return logical_to_spec(axes, rules, mesh)

    return jax.tree.map(spec, state, is_leaf=is_variable)


def param_shardings(state: nnx.State, mesh: Mesh, rules: Rules) -> nnx.State:
    """NamedSharding pytree for `state` (params, abstract or concrete) on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s),
                        param_specs(state, rules, mesh),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


# Activation constraints. The active (mesh, rules) pair is thread-local because the
# runtime traces trainer and slice functions from different threads.
_local = threading.local()


@contextlib.contextmanager
def activation_rules(mesh: Mesh | None, rules: Rules) -> Iterator[None]:
    """Within this context, `constrain` shards activations by `rules` on `mesh`.

    Enter it around the *tracing* of a jitted function (i.e. around its call).
    """
    prev = getattr(_local, "ctx", None)
    _local.ctx = None if mesh is None else (mesh, tuple(rules))
    try:
        yield
    finally:
        _local.ctx = prev


def active_rules() -> tuple | None:
    """The (mesh, rules) of the enclosing `activation_rules`, or None."""
    return getattr(_local, "ctx", None)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding constraint by logical names; a no-op outside `activation_rules`."""
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        return x
    mesh, rules = ctx
    spec = logical_to_spec(names, rules, mesh)
    # An axis that does not divide the dimension cannot shard it; leave it replicated
    # rather than fail (e.g. a batch of one prompt at prefill on a data-parallel mesh).
    fixed: list[str | tuple[str, ...] | None] = []
    for dim, axes in zip(x.shape, tuple(spec) + (None,) * (x.ndim - len(spec))):
        if axes is None:
            fixed.append(None)
            continue
        tup = (axes,) if isinstance(axes, str) else axes
        size = int(np.prod([mesh.shape[a] for a in tup]))
        fixed.append(axes if dim % size == 0 else None)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*fixed)))


@jax.jit
def copy_tree(tree: Any) -> Any:
    """A fresh copy of every array in `tree`, on the same devices and shardings: what
    must outlive a jitted step that donates the original (published params, a
    frozen reference, a throwaway state for compiling)."""
    return jax.tree.map(jnp.copy, tree)


def published_copy(tree: Any) -> Any:
    """A copy of `tree` that outlives the next train step (which donates it), in the
    form a decode slice loads, dispatched without waiting.

    On accelerators it stays on the trainer's devices and each slice pulls its shards
    device to device. On the CPU backend every "device" is host memory: one host copy
    lets each slice place it with a plain copy, where resharding device to device
    runs a cross-device program per slice (about 4x the weight-transfer time on the
    tiny default, contended by the decoding slices). A trainer spread over several
    processes gathers the tree first, so that this process holds all of it: every
    trainer process must call this at the same point (runtime/trainer_group.py)."""
    on_cpu = all(d.platform == "cpu" for x in jax.tree.leaves(tree) for d in x.devices())
    if not all(x.is_fully_addressable for x in jax.tree.leaves(tree)):
        tree = gathered(tree)  # fresh buffers: no step donates them
        return jax.device_get(tree) if on_cpu else tree
    return jax.device_get(tree) if on_cpu else copy_tree(tree)


def gathered(tree: Any) -> Any:
    """`tree` whole on this process's first device of its mesh: one program over the
    mesh, which every process holding part of it must run."""
    mesh = jax.tree.leaves(tree)[0].sharding.mesh
    whole = _replicated_on(mesh)(tree)
    return jax.tree.map(lambda x: x.addressable_shards[0].data, whole)


@functools.lru_cache(maxsize=8)
def _replicated_on(mesh: Mesh) -> Callable[[Any], Any]:
    """A program copying a tree onto every device of `mesh` (run by all its processes)."""
    return jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, PartitionSpec()))
