"""Decoder-only transformer (Llama / Qwen3 family, dense or MoE) in Flax NNX.

Two forward paths over the same params:
- `Transformer.__call__`: the full sequence (training, scoring, prefill), logits for
  every position, optionally the per-layer keys/values for a KV cache; a row may
  also pack several sequences (`segment_ids_BT`), each computed as if alone;
- `Transformer.decode`: one token for each of B slots, each at its own position,
  against an explicit `KVCache` pytree passed in and returned — the module never
  holds decode state, so one set of params can serve many caches and one cache can
  be driven by different param versions (as decode slices do).

Params are used functionally: `graphdef, params = nnx.split(model, nnx.Param)`,
then `apply(graphdef, params, ...)` inside jitted code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dora_jax.config import ModelConfig
from dora_jax.model import lora
from dora_jax.model.layers import Attention, RMSNorm, SwiGLU, param
from dora_jax.model.moe import MoE
from dora_jax.model.paged_attention import POOL_AXES, PageView
from dora_jax.model.sharding import constrain, is_variable

AUX_KEYS = ("load_balance_loss", "router_z_loss", "dropped_fraction")


class KVCache(NamedTuple):
    """Keys and values of every layer, each [layers, B, S, num_kv_heads, head_dim]: a
    prompt's prefix, as a forward pass returns it."""

    k: jax.Array
    v: jax.Array

    @property
    def length(self) -> int:
        return self.k.shape[2]


class LayerCaches(NamedTuple):
    """The decode state's keys and values: one buffer per layer, so that a step writes
    one token into each in place and attention reads a layer's buffer as it lies (a
    stacked [layers, ...] array would be sliced per layer, a copy per step).
    Dense: [B, num_kv_heads, S, head_dim] each; paged: a pool of pages each
    (paged_attention.py)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


def init_cache(cfg: ModelConfig, batch: int, length: int,
               dtype: jax.typing.DTypeLike | None = None) -> LayerCaches:
    """A dense cache: [B, kv_heads, length, head_dim] per layer (head-major, as
    decode attention reads it: attention.attend_cache)."""
    return _layer_buffers(cfg, (batch, cfg.num_kv_heads, length, cfg.head_dim), dtype)


CACHE_AXES = ("layers", "batch", "cache_length", "kv_heads", "head_dim")  # a prefix's
LAYER_CACHE_AXES = ("batch", "kv_heads", "cache_length", "head_dim")  # a layer's buffer


def init_pool(cfg: ModelConfig, num_pages: int, page_size: int,
              dtype: jax.typing.DTypeLike | None = None) -> LayerCaches:
    """A paged KV pool: [kv_heads, num_pages, page_size, head_dim] per layer."""
    return _layer_buffers(cfg, (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim), dtype)


def _layer_buffers(cfg: ModelConfig, shape: tuple[int, ...],
                   dtype: jax.typing.DTypeLike | None) -> LayerCaches:
    dtype = jnp.dtype(dtype or cfg.dtype)

    def buffers() -> tuple[jax.Array, ...]:
        return tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))

    return LayerCaches(buffers(), buffers())

# What a layer keeps for the backward pass (`model.remat`); "none": everything.
_CHECKPOINT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload_dots": jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        "device", "pinned_host"),
}


# One period of layers' (x, [k per layer], [v ...], [MoE aux ...]).
_Period = tuple[jax.Array, list[jax.Array], list[jax.Array], list[dict]]


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs) -> None:
        pd = jnp.dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.d_model, "embed", cfg.norm_eps, pd, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, "embed", cfg.norm_eps, pd, rngs=rngs)
        if cfg.is_moe_layer(layer):
            self.mlp = MoE(cfg, rngs=rngs)
        else:
            self.mlp = SwiGLU(cfg.d_model, cfg.mlp_hidden, pd, jnp.dtype(cfg.dtype), rngs=rngs,
                              cfg=cfg)
        self.is_moe = cfg.is_moe_layer(layer)

    def _mlp(self, x: jax.Array, dropless: bool, valid_BT: jax.Array | None = None,
             routing_BTK: jax.Array | None = None, replay: bool = False
             ) -> tuple[jax.Array, dict | None]:
        if self.is_moe:
            return self.mlp(x, dropless=dropless, valid_BT=valid_BT, routing_BTK=routing_BTK,
                            replay=replay)
        return self.mlp(x), None

    def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array, dropless: bool,
                 past: tuple | None = None, valid_BT: jax.Array | None = None,
                 segment_ids_BT: jax.Array | None = None, routing_BTK: jax.Array | None = None,
                 replay: bool = False
                 ) -> tuple[jax.Array, tuple[jax.Array, jax.Array], dict | None]:
        h, kv = self.attn(self.attn_norm(x_BTD), positions_BT, past, segment_ids_BT)
        x_BTD = x_BTD + h
        h, aux = self._mlp(self.mlp_norm(x_BTD), dropless, valid_BT, routing_BTK, replay)
        return x_BTD + h, kv, aux

    def decode(self, x_B1D: jax.Array, positions_B: jax.Array, k: jax.Array, v: jax.Array,
               pages: PageView | None = None, paged_impl: str = "auto"
               ) -> tuple[jax.Array, tuple[jax.Array, jax.Array], jax.Array | None]:
        """One token per slot against this layer's cache buffers `k`, `v` (a pool of
        pages with `pages`); returns them written."""
        if pages is None:
            h, kv = self.attn.decode(self.attn_norm(x_B1D), positions_B, k, v)
        else:
            h, kv = self.attn.decode_paged(self.attn_norm(x_B1D), positions_B, k, v, pages,
                                           paged_impl)
        x_B1D = x_B1D + h
        h, aux = self._mlp(self.mlp_norm(x_B1D), True)  # decoding is always exact
        return x_B1D + h, kv, None if aux is None else aux["experts"][:, 0]


def stack_layers(blocks: Sequence[Block]) -> Block:
    """One Block whose every param gains a leading "layers" axis: `blocks` stacked."""
    graphdef = nnx.graphdef(blocks[0])
    states = [nnx.split(b)[1] for b in blocks]
    firsts, treedef = jax.tree.flatten(states[0], is_leaf=is_variable)
    per_block = [[v[...] for v in jax.tree.leaves(s, is_leaf=is_variable)] for s in states]
    stacked = _stack_columns([list(column) for column in zip(*per_block)])

    def with_layers(first: nnx.Variable, value: jax.Array) -> nnx.Variable:
        meta = dict(first.get_metadata())
        meta["logical_axes"] = ("layers",) + tuple(meta.get("logical_axes") or ())
        return type(first)(value, **meta)

    return nnx.merge(graphdef, jax.tree.unflatten(
        treedef, [with_layers(f, x) for f, x in zip(firsts, stacked)]))


@jax.jit
def _stack_columns(columns: list[list[jax.Array]]) -> list[jax.Array]:
    # One program for every param (stacked op by op, each shape compiled its own).
    return [jnp.stack(column) for column in columns]


class Transformer(nnx.Module):
    """With `cfg.scan_layers`, `blocks[r]` holds layers r, r+p, r+2p, ... stacked
    (p = `cfg.layer_period`, the dense/MoE interleave) and one period is compiled
    once and scanned over the depth; otherwise `blocks[i]` is layer i."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        pd = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        # A tied table is also the output projection: init it for unit-variance logits.
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), pd,
                           std=cfg.d_model ** -0.5 if cfg.tie_embeddings else 1.0)
        blocks = [Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)]
        if cfg.scan_layers:
            p = cfg.layer_period
            blocks = [stack_layers(blocks[r::p]) for r in range(p)]
        self.blocks = nnx.List(blocks)
        self.final_norm = RMSNorm(cfg.d_model, "embed", cfg.norm_eps, pd, rngs=rngs)
        self.lm_head = (None if cfg.tie_embeddings else
                        param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), pd))

    def _embed(self, tokens: jax.Array) -> jax.Array:
        # The table's d_model gathered first, as every FSDP weight is before use: a
        # lookup (and its scatter-add gradient) from a table sharded on d_model into
        # rows sharded on the batch would make XLA replicate the whole activation.
        table = constrain(self.embed[...], ("vocab", None))
        return jnp.take(table, tokens, axis=0).astype(jnp.dtype(self.cfg.dtype))

    def _logits(self, x: jax.Array) -> jax.Array:
        x = self.final_norm(x)
        if self.lm_head is None:
            w = self.embed[...].T
        else:
            w = self.lm_head[...]
        return jnp.einsum("btd,dv->btv", x, w.astype(x.dtype),
                          preferred_element_type=jnp.float32)

    def _period(self, x: jax.Array, positions_BT: jax.Array, dropless: bool | None,
                graphdefs: Sequence[nnx.GraphDef], states: Sequence[nnx.State],
                past: tuple | None = None, valid_BT: jax.Array | None = None,
                segment_ids_BT: jax.Array | None = None, routing: jax.Array | None = None,
                replay: bool = False, return_routing: bool = False) -> _Period:
        """Layers of one period in order: (x, [k per layer], [v ...], [MoE aux ...]).
        past: None or (k [period, B, P, K, D], v, length) for these layers; routing:
        None or the recorded experts of this period's MoE layers [m, B, T, k]."""
        ks: list[jax.Array] = []
        vs: list[jax.Array] = []
        auxes: list[dict] = []
        for r, (graphdef, state) in enumerate(zip(graphdefs, states)):
            layer_past = None if past is None else (past[0][r], past[1][r], past[2])
            block = nnx.merge(graphdef, state)
            layer_routing = None if routing is None or not block.is_moe else routing[len(auxes)]
            x, (k, v), aux = block(x, positions_BT, dropless, layer_past, valid_BT,
                                   segment_ids_BT, layer_routing, replay)
            ks.append(k)
            vs.append(v)
            if aux is not None:
                if not return_routing:
                    del aux["experts"]
                auxes.append(aux)
        return x, ks, vs, auxes

    def __call__(self, tokens_BT: jax.Array, positions_BT: jax.Array | None = None, *,
                 dropless: bool | None = None, return_kv: bool = False, past: KVCache | None = None,
                 past_length: jax.Array | int | None = None, valid_BT: jax.Array | None = None,
                 segment_ids_BT: jax.Array | None = None, routing_BTLK: jax.Array | None = None,
                 replay: bool = False,
                 return_routing: bool = False) -> tuple[jax.Array, dict | None, KVCache | None]:
        """Full causal forward. Returns (logits_BTV f32, aux, kv or None).

        valid_BT: bool mask of real tokens (None: all); MoE layers route no padding
        and leave it out of their losses (causal attention needs no mask for right
        padding). aux holds the MoE losses averaged over MoE layers (zeros for a
        dense model);
        kv is a `KVCache` of this sequence's keys/values (length T) for prefill.
        past: the KV cache ([layers, B, P, ...]) of the `past_length` positions (a
        scalar, or one per row [B]) before `tokens_BT`, which then continue them
        (positions from past_length on): prefixes extended by a chunk each.
        segment_ids_BT: packed rows (int32 [B, T]): several sequences concatenated in
        a row, numbered 1, 2, ... contiguously, 0 for padding (anywhere). Each token
        attends only to earlier tokens of its own sequence, so a sequence's logits are
        those it has alone. positions_BT should then restart at 0 at each sequence
        (None: `segment_positions`), and valid_BT defaults to segment_ids_BT > 0.
        Not with `past`.
        routing_BTLK: the experts a rollout recorded per token and MoE layer (moe.py;
        ids >= num_experts: none recorded), replayed if `replay`; aux then holds
        `routing_agreeing` / `routing_recorded` (token-layers whose own top-k equals
        the record, and those recorded). return_routing: aux["routing"] is this
        forward's own top-k [B, T, MoE layers, k].
        """
        B, T = tokens_BT.shape
        if segment_ids_BT is not None:
            if past is not None:
                raise ValueError("packed rows (segment_ids_BT) cannot continue a past KV "
                                 "cache: pass one or the other")
            if positions_BT is None:
                positions_BT = segment_positions(segment_ids_BT)
            if valid_BT is None:
                valid_BT = segment_ids_BT > 0
        if positions_BT is None:  # past_length: a scalar, or one per row [B]
            start = 0 if past is None else jnp.reshape(past_length, (-1, 1))
            positions_BT = jnp.broadcast_to(start + jnp.arange(T), (B, T))
        x = constrain(self._embed(tokens_BT), ("batch", "length", "embed"))
        split = [nnx.split(b) for b in self.blocks]
        p = len(split)

        # [B, T, MoE layers, k] -> [MoE layers, B, T, k]: sliced per layer below.
        routing = None if routing_BTLK is None else jnp.moveaxis(routing_BTLK, 2, 0)

        # the blocks of `graphdefs` in order, rematerialised
        def layers(graphdefs: Sequence[nnx.GraphDef]) -> Callable[..., _Period]:
            def run(x: jax.Array, states: Sequence[nnx.State], past_kv: tuple | None = None,
                    routing: jax.Array | None = None) -> _Period:
                layer_past = None if past_kv is None else (*past_kv, past_length)
                return self._period(x, positions_BT, dropless, graphdefs, states, layer_past,
                                    valid_BT, segment_ids_BT, routing, replay,
                                    return_routing)
            if self.cfg.remat == "none":
                return run
            return jax.checkpoint(run, policy=_CHECKPOINT_POLICIES[self.cfg.remat])

        if self.cfg.scan_layers:
            period = layers([g for g, _ in split])

            def body(x: jax.Array, xs: tuple) -> tuple[jax.Array, tuple]:
                x, ks, vs, auxes = period(x, *xs)
                kv = (jnp.stack(ks), jnp.stack(vs)) if return_kv else None
                return x, (kv, auxes)

            # past [layers, ...] -> [n, p, ...]: the scan's step j holds layers j*p + r;
            # routing [MoE layers, ...] -> [n, m, ...] likewise (m MoE layers a period).
            past_xs = None if past is None else tuple(
                a.reshape(-1, p, *a.shape[1:]) for a in past)
            routing_xs = None if routing is None else routing.reshape(
                self.cfg.num_layers // p, -1, *routing.shape[1:])
            x, (kv, auxes) = jax.lax.scan(body, x, (tuple(s for _, s in split), past_xs,
                                                    routing_xs), unroll=self.cfg.unroll_forward)
            if return_kv:  # [n, p, ...] -> [layers, ...]: layer j*p + r
                k, v = (a.reshape(-1, *a.shape[2:]) for a in kv)
            # [n, B, T, k] per MoE layer of the period -> [MoE layers, B, T, k]
            own = (jnp.stack([a.pop("experts") for a in auxes], axis=1).reshape(
                -1, *tokens_BT.shape, self.cfg.moe.top_k) if return_routing and auxes else None)
        else:
            ks, vs, auxes, moe_index = [], [], [], 0
            for i, (graphdef, state) in enumerate(split):
                past_i = None if past is None else (past.k[i:i + 1], past.v[i:i + 1])
                m = int(self.cfg.is_moe_layer(i))
                routing_i = None if routing is None else routing[moe_index:moe_index + m]
                x, k1, v1, aux1 = layers([graphdef])(x, (state,), past_i, routing_i)
                moe_index += m
                ks += k1
                vs += v1
                auxes += aux1
            if return_kv:
                k, v = jnp.stack(ks), jnp.stack(vs)
            own = jnp.stack([a.pop("experts") for a in auxes]) if return_routing and auxes \
                else None
        logits = constrain(self._logits(x), ("batch", "length", "vocab"))
        aux = {key: (jnp.mean(jnp.concatenate([jnp.reshape(a[key], -1) for a in auxes]))
                     if auxes else jnp.zeros((), jnp.float32)) for key in AUX_KEYS}
        if auxes:  # per MoE layer [layers, E]: how evenly this router loads its experts
            aux["expert_load"] = jnp.concatenate(
                [a["expert_load"].reshape(-1, a["expert_load"].shape[-1]) for a in auxes])
        if routing is not None:
            for key in ("agreeing", "recorded"):
                aux[f"routing_{key}"] = sum(jnp.sum(a[key]) for a in auxes)
        if own is not None:
            aux["routing"] = jnp.moveaxis(own, 0, 2)  # [B, T, MoE layers, k]
        return logits, aux, (KVCache(k, v) if return_kv else None)

    def decode(self, tokens_B: jax.Array, positions_B: jax.Array, cache: LayerCaches,
               pages: PageView | None = None, paged_impl: str = "auto",
               return_routing: bool = False) -> tuple:
        """One decode step for B slots. Returns (logits_BV f32, updated cache), and with
        `return_routing` the experts each MoE layer chose for these tokens
        [B, MoE layers, k] (None for a dense model).

        The layers run one after another, unrolled: each reads its own cache buffers
        and, with per-layer params (`scan_layers=False`, as a decode slice holds them:
        model/layer_layout.py), its weights where they lie. Stacked params work too,
        each layer's sliced out of the stack, a copy per step.
        With `pages` (a `rollout.pages.PageView` of arrays) the cache is a paged pool
        (see paged_attention.py)."""
        x = self._embed(tokens_B[:, None])
        axes = LAYER_CACHE_AXES if pages is None else POOL_AXES
        ks, vs, found = [], [], []
        for layer in range(self.cfg.num_layers):
            x, (k, v), e = self._layer(layer).decode(x, positions_B, cache.k[layer],
                                                     cache.v[layer], pages, paged_impl)
            ks.append(constrain(k, axes))
            vs.append(constrain(v, axes))
            found += [] if e is None else [e]
        logits = self._logits(x)[:, 0]
        cache = LayerCaches(tuple(ks), tuple(vs))
        if not return_routing:
            return logits, cache
        return logits, cache, jnp.stack(found, axis=1) if found else None

    def _layer(self, layer: int) -> Block:
        if not self.cfg.scan_layers:
            return self.blocks[layer]
        p = len(self.blocks)
        graphdef, state = nnx.split(self.blocks[layer % p])
        return nnx.merge(graphdef, jax.tree.map(lambda x: x[layer // p], state))


def create(cfg: ModelConfig, seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
    """Builds a model and splits it: returns (graphdef, params)."""
    model = Transformer(cfg, rngs=nnx.Rngs(params=seed))
    return nnx.split(model, nnx.Param)


def abstract_params(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params as ShapeDtypeStructs) without allocating any memory."""
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))
    return nnx.split(model, nnx.Param)


def init_adapters(cfg: ModelConfig, seed: int) -> nnx.State:
    """The fresh adapters `create(cfg, seed)` makes, without materialising its base
    (compiled away): for a base read from a checkpoint."""
    return jax.jit(lambda: lora.split(create(cfg, seed)[1])[1])()


def publish_bytes(cfg: ModelConfig) -> dict:
    """What a new policy version would carry to a decode slice, from shapes alone:
    `full`, every weight of the model without adapters (a full fine-tuning publish:
    the base of the adapted model); `adapters`, the adapter tree of `cfg.lora` (a
    LoRA publish, the base held by the slice once); `ratio` = adapters / full."""
    base, adapters = lora.split(abstract_params(cfg)[1])
    out = {"full": lora.tree_bytes(base), "adapters": lora.tree_bytes(adapters)}
    return dict(out, ratio=out["adapters"] / out["full"])


def apply(graphdef: nnx.GraphDef, params: nnx.State, tokens_BT: jax.Array,
          positions_BT: jax.Array | None = None,
          **kwargs: Any) -> tuple[jax.Array, dict | None, KVCache | None]:
    """Functional full forward: `Transformer.__call__` on explicit params (packed
    rows: `segment_ids_BT=`)."""
    return nnx.merge(graphdef, params)(tokens_BT, positions_BT, **kwargs)


def segment_positions(segment_ids_BT: jax.Array) -> jax.Array:
    """Positions [B, T] (int32) of packed rows: 0 at the first token of each run of
    equal segment ids, counting up within it, so that RoPE restarts per sequence."""
    B, T = segment_ids_BT.shape
    t_T = jnp.arange(T, dtype=jnp.int32)
    starts_BT = jnp.concatenate([jnp.ones((B, 1), bool),
                                 segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
    run_start_BT = jax.lax.cummax(jnp.where(starts_BT, t_T, 0), axis=1)
    return t_T - run_start_BT


def decode(graphdef: nnx.GraphDef, params: nnx.State, tokens_B: jax.Array, positions_B: jax.Array,
           cache: LayerCaches, pages: PageView | None = None, paged_impl: str = "auto",
           return_routing: bool = False) -> tuple:
    """Functional decode step: `Transformer.decode` on explicit params."""
    return nnx.merge(graphdef, params).decode(tokens_B, positions_B, cache, pages, paged_impl,
                                              return_routing)


def count_params(params: object) -> int:
    """Number of scalars in a params pytree (concrete or abstract)."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


def token_logprobs(logits_BTV: jax.Array, tokens_BT: jax.Array,
                   temperature: float = 1.0) -> jax.Array:
    """log p(tokens[:, t] | tokens[:, :t]) at every t >= 1, under softmax(logits / T).

    Aligned with `tokens_BT`: column 0 (no context) is 0. Logits at position t
    predict token t+1, hence the shift.
    """
    logp_BTV = jax.nn.log_softmax(logits_BTV[:, :-1].astype(jnp.float32) / temperature, axis=-1)
    picked = jnp.take_along_axis(logp_BTV, tokens_BT[:, 1:, None], axis=-1)[..., 0]
    return jnp.pad(picked, ((0, 0), (1, 0)))
