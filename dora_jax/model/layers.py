"""Transformer building blocks: RMSNorm, rotary embeddings, GQA attention (kernels in
attention.py), SwiGLU.

Every param carries `logical_axes` metadata (see `sharding.py`); every activation
that crosses a layer boundary is constrained by logical names.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dora_jax.config import ModelConfig
from dora_jax.model import lora, threefry
from dora_jax.model.attention import attend, attend_cache, causal_attention
from dora_jax.model.paged_attention import PageView, paged_attention
from dora_jax.model.sharding import constrain


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: Sequence[str | None],
          dtype: jax.typing.DTypeLike, std: float | None = None, init: str = "normal") -> nnx.Param:
    """A Param with logical axes; normal(0, std) init, std defaulting to 1/sqrt(fan_in)."""
    if init == "ones":
        value = jnp.ones(shape, dtype)
    else:
        std = std if std is not None else shape[0] ** -0.5
        value = _normal(rngs.params(), tuple(shape), float(std), jnp.dtype(dtype))
    return nnx.Param(value, logical_axes=tuple(axes))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _normal(key: jax.Array, shape: tuple[int, ...], std: float, dtype: jnp.dtype) -> jax.Array:
    """normal(0, std) as `dtype`: one program per shape, std and dtype, compiled in
    about half the time JAX's own draw takes on a CPU (model/threefry.py). `std` is
    static: a traced float enters the call as a constant, and the error text JAX
    builds for a tracer (nnx's Rngs asks for one at every draw) prints in full each
    call taking a constant; each abstract trace of a model took 4x as long."""
    return (std * threefry.normal(key, shape)).astype(dtype)


def dense(x: jax.Array, w: jax.Array, contract: int = 1) -> jax.Array:
    """x's last `contract` dims times w's first ones, as one 2-D matmul. XLA's CPU
    backend gives the backward of a batched einsum (`btd,df->btf`) transposing copies
    that took a fifth of a train step; on a TPU or GPU the reshapes are free."""
    n = math.prod(w.shape[:contract])
    y = x.reshape(-1, n) @ w.reshape(n, -1)
    return y.reshape(*x.shape[:x.ndim - contract], *w.shape[contract:])


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, axis_name: str, eps: float, param_dtype: jax.typing.DTypeLike, *,
                 rngs: nnx.Rngs) -> None:
        self.scale = param(rngs, (dim,), (axis_name,), param_dtype, init="ones")
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        # Normalise in f32 whatever the compute dtype: bf16 variance is too coarse.
        x32 = x.astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * inv * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim / 2] of the rotary embedding (f32), with the
    config's scaling. `llama3` (Llama 3.1): wavelengths above
    original_max_len / low_freq_factor are stretched by `rope_factor`, those below
    original_max_len / high_freq_factor kept, and the band between blended linearly
    in original_max_len / wavelength."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(half, dtype=np.float64) * 2.0 / cfg.head_dim)
    if cfg.rope_scaling == "llama3":
        wavelength = 2 * np.pi / inv_freq
        old, low, high = (cfg.rope_original_max_len, cfg.rope_low_freq_factor,
                          cfg.rope_high_freq_factor)
        blend = np.clip((old / wavelength - low) / (high - low), 0.0, 1.0)
        inv_freq = (1 - blend) * inv_freq / cfg.rope_factor + blend * inv_freq
    return inv_freq.astype(np.float32)


def rope(x_BTHD: jax.Array, positions_BT: jax.Array,
         inv_freq_F: jax.Array | np.ndarray) -> jax.Array:
    """Rotary embedding, half-split convention (Llama / Qwen), computed in f32."""
    half = x_BTHD.shape[-1] // 2
    angles_BTF = positions_BT[..., None].astype(jnp.float32) * jnp.asarray(inv_freq_F)
    sin = jnp.sin(angles_BTF)[:, :, None, :]
    cos = jnp.cos(angles_BTF)[:, :, None, :]
    x = x_BTHD.astype(jnp.float32)
    x1, x2 = x[..., :half], x[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTHD.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        pd = jnp.dtype(cfg.param_dtype)
        D, H, K, Dh = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq = param(rngs, (D, H, Dh), ("embed", "heads", "head_dim"), pd)
        self.wk = param(rngs, (D, K, Dh), ("embed", "kv_heads", "head_dim"), pd)
        self.wv = param(rngs, (D, K, Dh), ("embed", "kv_heads", "head_dim"), pd)
        self.wo = param(rngs, (H, Dh, D), ("heads", "head_dim", "embed"), pd,
                        std=(H * Dh) ** -0.5)
        if cfg.qkv_bias:
            self.bq = param(rngs, (H, Dh), ("heads", "head_dim"), pd, std=0.0)
            self.bk = param(rngs, (K, Dh), ("kv_heads", "head_dim"), pd, std=0.0)
            self.bv = param(rngs, (K, Dh), ("kv_heads", "head_dim"), pd, std=0.0)
        else:
            self.bq = self.bk = self.bv = None
        self.q_norm: RMSNorm | None
        self.k_norm: RMSNorm | None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(Dh, "head_dim", cfg.norm_eps, pd, rngs=rngs)
            self.k_norm = RMSNorm(Dh, "head_dim", cfg.norm_eps, pd, rngs=rngs)
        else:
            self.q_norm = self.k_norm = None
        # Adapters after the base weights, from a stream of their own.
        lr = lora.adapter_rngs(rngs) if cfg.lora.enabled else None
        d, hk = ((D,), ("embed",)), ((H, Dh), ("heads", "head_dim"))
        self.lora_q = lora.make(cfg, "q", lr, *d, *hk)
        self.lora_k = lora.make(cfg, "k", lr, *d, (K, Dh), ("kv_heads", "head_dim"))
        self.lora_v = lora.make(cfg, "v", lr, *d, (K, Dh), ("kv_heads", "head_dim"))
        self.lora_o = lora.make(cfg, "o", lr, *hk, *d)
        # Static: a tuple of floats, so the module holds no array outside its params.
        self.inv_freq = tuple(float(f) for f in rope_frequencies(cfg))
        self.dtype = jnp.dtype(cfg.dtype)
        self.implementation, self.block = cfg.attention, cfg.attention_block

    def _qkv(self, x_BTD: jax.Array, positions_BT: jax.Array
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
        dt = self.dtype
        q = lora.adapt(self.lora_q, x_BTD,
                       dense(x_BTD, self.wq[...].astype(dt)))
        k = lora.adapt(self.lora_k, x_BTD,
                       dense(x_BTD, self.wk[...].astype(dt)))
        v = lora.adapt(self.lora_v, x_BTD,
                       dense(x_BTD, self.wv[...].astype(dt)))
        if self.bq is not None:
            q, k, v = (y + b[...].astype(dt) for y, b in ((q, self.bq), (k, self.bk), (v, self.bv)))
        if self.q_norm is not None and self.k_norm is not None:  # set together
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = np.asarray(self.inv_freq, np.float32)
        q = rope(q, positions_BT, inv_freq)
        k = rope(k, positions_BT, inv_freq)
        q = constrain(q, ("batch", "length", "heads", "head_dim"))
        k = constrain(k, ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        return q, k, v

    def _out(self, o_BTHD: jax.Array) -> jax.Array:
        y = lora.adapt(self.lora_o, o_BTHD,
                       dense(o_BTHD, self.wo[...].astype(self.dtype), contract=2))
        return constrain(y, ("batch", "length", "embed"))

    def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array, past: tuple | None = None,
                 segment_ids_BT: jax.Array | None = None
                 ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Causal self-attention over the sequence; also returns its (k, v).

        past: (k_BPKD, v_BPKD, length) of positions before this sequence, of which
        the first `length` (a scalar, or one per row [B]) are real: every token also
        attends to them (a prefix extended, not recomputed).
        segment_ids_BT: packed rows (int, 0 padding): attention stays within each
        segment (see attention.py); not with `past`."""
        q, k, v = self._qkv(x_BTD, positions_BT)
        if past is None:
            o = causal_attention(q, k, v, self.implementation, self.block,
                                 segment_ids_BT=segment_ids_BT)
            return self._out(o), (k, v)
        past_k, past_v, length = past
        B, T, P = x_BTD.shape[0], x_BTD.shape[1], past_k.shape[1]
        held_B11 = jnp.reshape(length, (-1, 1, 1))
        mask_BTS = jnp.concatenate([jnp.broadcast_to(jnp.arange(P) < held_B11, (B, T, P)),
                                    jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)),
                                                     (B, T, T))], axis=2)
        o = attend(q, jnp.concatenate([past_k.astype(self.dtype), k], axis=1),
                   jnp.concatenate([past_v.astype(self.dtype), v], axis=1), mask_BTS)
        return self._out(o), (k, v)

    def decode(self, x_B1D: jax.Array, positions_B: jax.Array, k_cache_BKSD: jax.Array,
               v_cache_BKSD: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """One token per slot: writes its k/v into this layer's cache ([B, kv_heads,
        S, head_dim]) at the slot's own position (in place when the cache is
        donated), then attends to every cached position up to and including it."""
        q, k, v = self._qkv(x_B1D, positions_B[:, None])
        rows = jnp.arange(x_B1D.shape[0])
        k_cache_BKSD = k_cache_BKSD.at[rows, :, positions_B].set(
            k[:, 0].astype(k_cache_BKSD.dtype))
        v_cache_BKSD = v_cache_BKSD.at[rows, :, positions_B].set(
            v[:, 0].astype(v_cache_BKSD.dtype))
        o = attend_cache(q[:, 0], k_cache_BKSD.astype(self.dtype),
                         v_cache_BKSD.astype(self.dtype), positions_B + 1)
        return self._out(o[:, None]), (k_cache_BKSD, v_cache_BKSD)

    def decode_paged(self, x_B1D: jax.Array, positions_B: jax.Array, k_pool_KPpD: jax.Array,
                     v_pool_KPpD: jax.Array, view: PageView, implementation: str
                     ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """`decode` on this layer's paged pool ([kv_heads, pages, page_size, head_dim]):
        the new k/v go to the slot's page for its position (idle slots' to the null
        page 0); attention reads only the pages `view` maps (see paged_attention.py)."""
        q, k, v = self._qkv(x_B1D, positions_B[:, None])
        page_size = k_pool_KPpD.shape[2]
        rows = jnp.arange(x_B1D.shape[0])
        page_B = jnp.where(view.owned, view.table[rows, positions_B // page_size], 0)
        offset_B = positions_B % page_size
        # [kv_heads, B, head_dim]: one entry per slot, at its page and offset
        k_KBD, v_KBD = (x[:, 0].swapaxes(0, 1).astype(k_pool_KPpD.dtype) for x in (k, v))
        k_pool_KPpD = k_pool_KPpD.at[:, page_B, offset_B].set(k_KBD)
        v_pool_KPpD = v_pool_KPpD.at[:, page_B, offset_B].set(v_KBD)
        o = paged_attention(q[:, 0], k_pool_KPpD, v_pool_KPpD, positions_B + 1, view,
                            implementation)
        return self._out(o[:, None]), (k_pool_KPpD, v_pool_KPpD)


class SwiGLU(nnx.Module):
    def __init__(self, d_model: int, hidden: int, param_dtype: jax.typing.DTypeLike,
                 dtype: jax.typing.DTypeLike, *, rngs: nnx.Rngs,
                 cfg: ModelConfig | None = None) -> None:
        """cfg: the ModelConfig, whose `lora` may adapt gate / up / down."""
        self.w_gate = param(rngs, (d_model, hidden), ("embed", "mlp"), param_dtype)
        self.w_up = param(rngs, (d_model, hidden), ("embed", "mlp"), param_dtype)
        self.w_down = param(rngs, (hidden, d_model), ("mlp", "embed"), param_dtype)
        self.dtype = dtype
        lr = lora.adapter_rngs(rngs) if cfg is not None and cfg.lora.enabled else None
        d, f = ((d_model,), ("embed",)), ((hidden,), ("mlp",))
        self.lora_gate = lora.make(cfg, "gate", lr, *d, *f)
        self.lora_up = lora.make(cfg, "up", lr, *d, *f)
        self.lora_down = lora.make(cfg, "down", lr, *f, *d)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        dt = self.dtype
        gate = lora.adapt(self.lora_gate, x_BTD,
                          dense(x_BTD, self.w_gate[...].astype(dt)))
        up = lora.adapt(self.lora_up, x_BTD,
                        dense(x_BTD, self.w_up[...].astype(dt)))
        h = constrain(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
        y = lora.adapt(self.lora_down, h,
                       dense(h, self.w_down[...].astype(dt)))
        return constrain(y, ("batch", "length", "embed"))
