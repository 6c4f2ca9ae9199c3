"""Low-rank adapters (LoRA, Hu et al. 2021) on the policy's projections.

A targeted projection y = W x gains A [in, r] and B [r, out] (`model.lora`): y = W x +
alpha / r * B (A x). A starts small and random (PEFT's kaiming-uniform bound,
1/sqrt(fan_in)), B at zero, so a fresh adapter leaves the model exactly the base.
Adapters are params named `lora_a` / `lora_b` under a `lora_<target>` module next
to the weight they adapt (`attn/lora_q` for `attn/wq`, `mlp/lora_gate` for
`mlp/w_gate`; an MoE layer's `mlp/lora_gate` adapts every expert's `w_gate`, with A
[E, in, r] and B [E, r, out]). Their logical axes are the weight's: A's input axes,
B's output axes, and "lora_rank" (replicated) between, so the sharding rules lay
them out like the weight.

`split` / `merge` separate the base from the adapters (what the trainer optimises,
what a publish of a new version must carry); `merged_weights` folds the adapters
into W for export, giving the params of the same model without adapters.

Several versions at once (a decode slice serving each slot under its own version):
each adapter leaf then holds V adapter sets, stacked on a "place" axis after the
layers axis, and `rows(place_B)` says which place each batch row uses. Every row is
projected through each place's A, keeps its own place's rank-r activations and goes
through the stacked Bs as one contraction: dense matmuls, V times the adapters' small
FLOPs, however many versions a step serves.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from dora_jax.model import threefry

if TYPE_CHECKING:
    from dora_jax.config import LoRAConfig, ModelConfig

ADAPTER_KEYS = ("lora_a", "lora_b")
# The weight each target adapts, in its module (attention or MLP / MoE).
WEIGHT_OF = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up",
             "down": "w_down"}
_STREAM_TAG = 0x4C6F5241  # folds adapter keys away from the base's
# The place of each batch row while a forward with stacked adapters is traced: set
# around the model call by the engine's programs (`rows`), read by `LoRA.__call__`.
_ROWS: contextvars.ContextVar = contextvars.ContextVar("lora_rows", default=None)


@contextlib.contextmanager
def rows(place_B: jax.Array) -> Iterator[None]:
    """Within it, stacked adapters [V, ...] apply place_B[b] (int32 [B]) to row b."""
    token = _ROWS.set(place_B)
    try:
        yield
    finally:
        _ROWS.reset(token)


def adapter_rngs(rngs: nnx.Rngs) -> nnx.Rngs:
    """A stream for adapter init that leaves `rngs` where it was: the base weights
    drawn after it are those of the same model without adapters."""
    s = rngs.params
    key = jax.random.fold_in(jax.random.fold_in(s.key[...], s.count[...]), _STREAM_TAG)
    return nnx.Rngs(params=key)


class LoRA(nnx.Module):
    """The adapter of one projection whose weight is [*lead, *in_shape, *out_shape]
    (lead: the experts of an MoE layer, or nothing)."""

    def __init__(self, lora_cfg: LoRAConfig, in_shape: tuple[int, ...],
                 in_axes: tuple[str | None, ...], out_shape: tuple[int, ...],
                 out_axes: tuple[str | None, ...], *, rngs: nnx.Rngs, lead: tuple[int, ...] = (),
                 lead_axes: tuple[str | None, ...] = ()) -> None:
        dt, r = jnp.dtype(lora_cfg.dtype), lora_cfg.rank
        bound = math.prod(in_shape) ** -0.5
        a = threefry.uniform(rngs.params(), (*lead, *in_shape, r), -bound, bound)
        self.lora_a = nnx.Param(a.astype(dt),
                                logical_axes=(*lead_axes, *in_axes, "lora_rank"))
        self.lora_b = nnx.Param(jnp.zeros((*lead, r, *out_shape), dt),
                                logical_axes=(*lead_axes, "lora_rank", *out_axes))
        self.scale = float(lora_cfg.scale)
        self.num_in = len(in_shape)

    def __call__(self, x: jax.Array) -> jax.Array:
        """scale * B (A x) for x [..., *in_shape]: [..., *out_shape], in x's dtype."""
        a = self.lora_a[...].astype(x.dtype)
        if a.ndim == self.num_in + 2:  # stacked places: each row its own (`rows`)
            return self._per_row(x, a, self.lora_b[...].astype(x.dtype))
        h = jnp.tensordot(x, a, axes=self.num_in) * jnp.asarray(self.scale, x.dtype)
        return jnp.tensordot(h, self.lora_b[...].astype(x.dtype), axes=1)

    def _per_row(self, x: jax.Array, a_VIR: jax.Array, b_VRO: jax.Array) -> jax.Array:
        place_B = _ROWS.get()
        if place_B is None:
            raise ValueError("stacked adapters need each row's place: call the model "
                             "within lora.rows(place_B)")
        V, r = a_VIR.shape[0], a_VIR.shape[-1]
        lead, out_shape = x.shape[:x.ndim - self.num_in], b_VRO.shape[2:]
        M = math.prod(lead)
        place_M = jnp.broadcast_to(
            place_B.reshape(place_B.shape[0], *[1] * (len(lead) - 1)), lead).reshape(M)
        # Every place's rank-r projection, each row keeping its own: dense matmuls with
        # no sort or scatter. V times the adapters' FLOPs (r / d of the weight's each),
        # and faster than grouping rows by place with ragged_dot at decode sizes.
        h_MVR = jnp.einsum("mi,vir->mvr", x.reshape(M, -1), a_VIR.reshape(V, -1, r))
        keep_MV = jax.nn.one_hot(place_M, V, dtype=x.dtype) * jnp.asarray(self.scale, x.dtype)
        y_MO = jnp.einsum("mvr,vro->mo", h_MVR * keep_MV[:, :, None], b_VRO.reshape(V, r, -1))
        return y_MO.reshape(*lead, *out_shape)

    def experts(self, x_ECD: jax.Array) -> jax.Array:
        """Per expert (capacity dispatch): x [E, C, in] -> [E, C, out]."""
        dt = x_ECD.dtype
        h_ECR = jnp.einsum("ecd,edr->ecr", x_ECD, self.lora_a[...].astype(dt))
        h_ECR = h_ECR * jnp.asarray(self.scale, dt)
        return jnp.einsum("ecr,erf->ecf", h_ECR, self.lora_b[...].astype(dt))

    def ragged(self, x_MD: jax.Array, sizes_E: jax.Array) -> jax.Array:
        """Per expert (dropless dispatch): rows of x [M, in] grouped by expert as
        `jax.lax.ragged_dot` groups them -> [M, out]."""
        dt = x_MD.dtype
        h_MR = jax.lax.ragged_dot(x_MD, self.lora_a[...].astype(dt), sizes_E)
        h_MR = h_MR * jnp.asarray(self.scale, dt)
        return jax.lax.ragged_dot(h_MR, self.lora_b[...].astype(dt), sizes_E)


def make(cfg: ModelConfig | None, target: str, rngs: nnx.Rngs | None,
         in_shape: tuple[int, ...], in_axes: tuple[str | None, ...], out_shape: tuple[int, ...],
         out_axes: tuple[str | None, ...], **lead: Any) -> LoRA | None:
    """The adapter of `target` when `cfg.lora` (ModelConfig) adapts it and `rngs` (an
    `adapter_rngs` stream, None: no adapters in this module) is given, else None."""
    if rngs is None or cfg is None or not cfg.lora.enabled or target not in cfg.lora.targets:
        return None
    return LoRA(cfg.lora, in_shape, in_axes, out_shape, out_axes, rngs=rngs, **lead)


def adapt(adapter: LoRA | None, x: jax.Array, y: jax.Array) -> jax.Array:
    """y plus the adapter's term on x (y itself without an adapter)."""
    return y if adapter is None else y + adapter(x)


def _keys(path: jax.tree_util.KeyPath) -> tuple[str, ...]:
    """A leaf path as plain keys, without the Variable's trailing `.value`."""
    keys = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
    return keys[:-1] if keys and keys[-1] == "value" else keys


def _is_adapter(path: jax.tree_util.KeyPath, _: object = None) -> bool:
    keys = _keys(path)
    return bool(keys) and keys[-1] in ADAPTER_KEYS


def split(params: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(base, adapters) of a params nnx.State; `merge` puts them back together."""
    adapters, base = nnx.split_state(params, _is_adapter, ...)
    return base, adapters


def merge(base: nnx.State, adapters: nnx.State) -> nnx.State:
    return nnx.merge_state(base, adapters)


def has_adapters(params: nnx.State) -> bool:
    return any(_is_adapter(p) for p, _ in jax.tree_util.tree_leaves_with_path(params))


def zero_adapters(params: nnx.State) -> nnx.State:
    """`params` with every B at zero: the base model in the adapted model's tree (the
    KL reference of a LoRA run)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.zeros_like(x) if _keys(p)[-1] == "lora_b" else x, params)


def merged_weights(params: nnx.State, lora_cfg: LoRAConfig) -> nnx.State:
    """The params of the same model without adapters (`lora_cfg.rank` 0): each
    adapted W becomes W + scale * A B, summed in f32 and stored in W's dtype."""
    base, adapters = split(params)
    found = {_keys(p): x for p, x in jax.tree_util.tree_leaves_with_path(adapters)}
    target_of = {w: t for t, w in WEIGHT_OF.items()}

    def fold(path: jax.tree_util.KeyPath, w: jax.Array) -> jax.Array:
        *module, name = _keys(path)
        a = found.get((*module, f"lora_{target_of.get(name)}", "lora_a"))
        if a is None:
            return w
        b = found[(*module, f"lora_{target_of[name]}", "lora_b")]
        lead = a.ndim + b.ndim - 2 - w.ndim  # layers, experts
        num_in, r = a.ndim - 1 - lead, a.shape[-1]
        a_LIR = a.reshape(*a.shape[:lead], math.prod(a.shape[lead:lead + num_in]), r)
        b_LRO = b.reshape(*b.shape[:lead], r, -1)
        delta = jnp.matmul(a_LIR.astype(jnp.float32), b_LRO.astype(jnp.float32))
        return (w.astype(jnp.float32) + lora_cfg.scale * delta.reshape(w.shape)).astype(w.dtype)

    return jax.tree_util.tree_map_with_path(fold, base)


def base_config(model_cfg: ModelConfig) -> ModelConfig:
    """`model_cfg` without adapters: the base model's architecture."""
    import dataclasses

    from dora_jax.config.model import LoRAConfig

    return dataclasses.replace(model_cfg, lora=LoRAConfig())


def tree_bytes(tree: object) -> int:
    """Bytes of the arrays of a pytree (concrete or abstract)."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
