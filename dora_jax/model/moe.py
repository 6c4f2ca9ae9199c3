"""Mixture-of-experts feed-forward: top-k softmax router, stacked SwiGLU experts.

Two dispatch paths over the same weights:
- dropless: every (token, expert) assignment is computed, grouped by expert with
  `jax.lax.ragged_dot` — exact, used for decoding and whenever exactness matters;
- capacity: each expert takes at most C = ceil(capacity_factor * N * k / E)
  assignments (GShard/Switch). Assignments are served in priority order — every
  token's first choice in token order, then every second choice, and so on — and
  those past an expert's capacity are dropped (they contribute nothing; the
  residual connection carries the token on).

Training uses dropless unless `model.moe.dispatch` is "capacity": decoding is always
dropless, so only then do train and decode log-probs of the same tokens agree. Even
so, in bfloat16 near-tied router scores can flip between decode and training; a
rollout's recorded experts can be replayed (`route`'s `replay_NK`,
`trainer.moe_routing`; docs/objective.md "MoE: routing replay").

The load-balancing loss is E * sum_i f_i * P_i with f_i the fraction of top-k
assignments routed to expert i and P_i the mean router probability of expert i
(Switch / GShard form; minimum 1 at perfectly uniform routing). The router z-loss is
mean_tokens(logsumexp(router_logits)^2). Both are returned, not added: the trainer
weighs them.

With a token mask (`valid_BT`: a train batch's padding, anywhere in packed rows)
padding is never routed: no expert compute, no capacity, no part of either loss.
Routing is per token, so a packed row equals its sequences run apart, losses
included. Capacity dropping is the exception: C is set by the whole batch (B * T,
padding included) and the priority order runs across rows, so what is dropped
depends on the rest of the batch (unpacked too); packed rows then equal their
sequences run apart only when nothing is dropped.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from dora_jax.model import lora
from dora_jax.model.layers import SwiGLU, param
from dora_jax.model.sharding import constrain

if TYPE_CHECKING:
    from dora_jax.config import ModelConfig


def route(router_logits_NE: jax.Array, top_k: int, normalize: bool,
          replay_NK: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k softmax routing: returns (expert ids [N,k], weights [N,k], probs [N,E]).

    With `replay_NK` (recorded expert ids; an id >= E marks a token not recorded) a
    recorded token goes to its recorded experts, gated by this router's probabilities
    of them: the experts the rollout used, the gates (and their gradient) this
    policy's."""
    probs_NE = jax.nn.softmax(router_logits_NE.astype(jnp.float32), axis=-1)
    weights_NK, experts_NK = jax.lax.top_k(probs_NE, top_k)
    if replay_NK is not None:
        recorded_N = replay_NK[:, 0] < probs_NE.shape[-1]
        experts_NK = jnp.where(recorded_N[:, None], replay_NK.astype(jnp.int32), experts_NK)
        weights_NK = jnp.take_along_axis(probs_NE, experts_NK, axis=-1)
    if normalize:
        weights_NK = weights_NK / jnp.sum(weights_NK, axis=-1, keepdims=True)
    return experts_NK, weights_NK, probs_NE


def recorded_tokens(recorded_NK: jax.Array, num_experts: int,
                    valid_N: jax.Array | None = None) -> jax.Array:
    """bool [N]: the valid tokens with a record."""
    counted_N = recorded_NK[:, 0] < num_experts
    return counted_N if valid_N is None else counted_N & valid_N


def routing_agreement(own_NK: jax.Array, recorded_NK: jax.Array, num_experts: int,
                      valid_N: jax.Array | None = None) -> tuple:
    """(tokens whose own top-k set equals the recorded one, recorded tokens), over
    the valid tokens with a record."""
    counted_N = recorded_tokens(recorded_NK, num_experts, valid_N)
    same_N = jnp.all(jnp.sort(own_NK, axis=-1) == jnp.sort(recorded_NK.astype(jnp.int32),
                                                           axis=-1), axis=-1)
    return (jnp.sum(same_N & counted_N).astype(jnp.float32),
            jnp.sum(counted_N).astype(jnp.float32))


def expert_counts(experts_NK: jax.Array, num_experts: int,
                  counted_N: jax.Array | None = None) -> jax.Array:
    """Assignments per expert [E] of the counted tokens (ids >= E are not counted)."""
    ids = experts_NK.astype(jnp.int32)
    if counted_N is not None:
        ids = jnp.where(counted_N[:, None], ids, num_experts)
    return jnp.zeros(num_experts + 1, jnp.float32).at[ids.reshape(-1)].add(
        1.0, mode="drop")[:num_experts]


def _token_weights(n: int, valid_N: jax.Array | None) -> jax.Array:
    return jnp.ones(n, jnp.float32) if valid_N is None else valid_N.astype(jnp.float32)


def load_balance_loss(experts_NK: jax.Array, probs_NE: jax.Array,
                      valid_N: jax.Array | None = None) -> jax.Array:
    """E * sum_i f_i * P_i (see module docstring), over the valid tokens."""
    N, K = experts_NK.shape
    num_experts = probs_NE.shape[-1]
    w_N = _token_weights(N, valid_N)
    counts_E = expert_counts(experts_NK, num_experts, valid_N)
    n = jnp.maximum(jnp.sum(w_N), 1.0)
    f_E = counts_E / (n * K)
    p_E = jnp.sum(probs_NE * w_N[:, None], axis=0) / n
    return num_experts * jnp.sum(f_E * p_E)


def router_z_loss(router_logits_NE: jax.Array, valid_N: jax.Array | None = None) -> jax.Array:
    w_N = _token_weights(router_logits_NE.shape[0], valid_N)
    z_N = jax.nn.logsumexp(router_logits_NE.astype(jnp.float32), axis=-1) ** 2
    return jnp.sum(z_N * w_N) / jnp.maximum(jnp.sum(w_N), 1.0)


def capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def capacity_dispatch(experts_NK: jax.Array, weights_NK: jax.Array, num_experts: int, cap: int,
                      valid_N: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Dispatch [N,E,C] and combine [N,E,C] tensors with priority-order dropping;
    invalid tokens take no slot. Also returns the fraction of valid assignments
    dropped."""
    N, K = experts_NK.shape
    # Rank-major order: all first choices (by token) before any second choice.
    onehot_KNE = jax.nn.one_hot(experts_NK.T, num_experts, dtype=jnp.int32)
    if valid_N is not None:
        onehot_KNE = onehot_KNE * valid_N.astype(jnp.int32)[None, :, None]
    slot_KNE = jnp.cumsum(onehot_KNE.reshape(K * N, num_experts), axis=0).reshape(
        K, N, num_experts) - 1
    keep_KNE = (onehot_KNE > 0) & (slot_KNE < cap)
    slot_onehot_KNEC = jax.nn.one_hot(jnp.where(keep_KNE, slot_KNE, -1), cap, dtype=jnp.float32)
    dispatch_NEC = jnp.sum(slot_onehot_KNEC, axis=0)
    combine_NEC = jnp.einsum("knec,kn->nec", slot_onehot_KNEC, weights_NK.T.astype(jnp.float32))
    assigned = jnp.maximum(jnp.sum(onehot_KNE), 1)
    return dispatch_NEC, combine_NEC, 1.0 - jnp.sum(keep_KNE) / assigned


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        m = cfg.moe
        pd, dt = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.dtype)
        D, E, F = cfg.d_model, m.num_experts, m.expert_hidden
        self.router = param(rngs, (D, E), ("embed", None), pd)
        self.w_gate = param(rngs, (E, D, F), ("expert", "embed", "expert_mlp"), pd, std=D ** -0.5)
        self.w_up = param(rngs, (E, D, F), ("expert", "embed", "expert_mlp"), pd, std=D ** -0.5)
        self.w_down = param(rngs, (E, F, D), ("expert", "expert_mlp", "embed"), pd, std=F ** -0.5)
        self.shared = (SwiGLU(D, m.num_shared_experts * m.shared_expert_hidden, pd, dt,
                              rngs=rngs, cfg=cfg) if m.num_shared_experts else None)
        # Per expert (model.lora.experts): A [E, in, r], B [E, r, out].
        lr = lora.adapter_rngs(rngs) if cfg.lora.enabled and cfg.lora.experts else None
        d, f = ((D,), ("embed",)), ((F,), ("expert_mlp",))
        e: dict[str, Any] = dict(lead=(E,), lead_axes=("expert",))
        self.lora_gate = lora.make(cfg, "gate", lr, *d, *f, **e)
        self.lora_up = lora.make(cfg, "up", lr, *d, *f, **e)
        self.lora_down = lora.make(cfg, "down", lr, *f, *d, **e)
        self.num_experts, self.top_k = E, m.top_k
        self.normalize = m.normalize_topk
        self.capacity_factor = m.capacity_factor
        self.capacity_dispatch = m.dispatch == "capacity"
        self.dtype = dt

    def _experts(self, x_ECD: jax.Array) -> jax.Array:
        dt = self.dtype

        def adapt(adapter: lora.LoRA | None, x: jax.Array, y: jax.Array) -> jax.Array:
            return y if adapter is None else y + adapter.experts(x)

        gate = adapt(self.lora_gate, x_ECD,
                     jnp.einsum("ecd,edf->ecf", x_ECD, self.w_gate[...].astype(dt)))
        up = adapt(self.lora_up, x_ECD,
                   jnp.einsum("ecd,edf->ecf", x_ECD, self.w_up[...].astype(dt)))
        h = constrain(jax.nn.silu(gate) * up, ("expert", None, "expert_mlp"))
        return adapt(self.lora_down, h,
                     jnp.einsum("ecf,efd->ecd", h, self.w_down[...].astype(dt)))

    def _dropless(self, x_ND: jax.Array, experts_NK: jax.Array, weights_NK: jax.Array,
                  valid_N: jax.Array | None = None) -> jax.Array:
        dt = self.dtype
        N, K = experts_NK.shape
        flat_e = experts_NK.reshape(-1)
        if valid_N is not None:
            # Padding goes to a group past the last expert: sorted to the end and
            # outside every group size, ragged_dot computes nothing for it (zeros).
            flat_e = jnp.where(jnp.repeat(valid_N, K), flat_e, self.num_experts)
            weights_NK = weights_NK * valid_N[:, None]
        order = jnp.argsort(flat_e, stable=True)
        x_sorted_MD = x_ND[order // K]
        sizes_E = jnp.zeros(self.num_experts, jnp.int32).at[flat_e].add(1, mode="drop")

        def grouped(w: nnx.Param, adapter: lora.LoRA | None, x_MD: jax.Array) -> jax.Array:
            y = jax.lax.ragged_dot(x_MD, w[...].astype(dt), sizes_E)
            return y if adapter is None else y + adapter.ragged(x_MD, sizes_E)

        gate = grouped(self.w_gate, self.lora_gate, x_sorted_MD)
        up = grouped(self.w_up, self.lora_up, x_sorted_MD)
        y_sorted_MD = grouped(self.w_down, self.lora_down, jax.nn.silu(gate) * up)
        y_MD = jnp.zeros_like(y_sorted_MD).at[order].set(y_sorted_MD)
        y_NKD = y_MD.reshape(N, K, -1)
        return jnp.einsum("nkd,nk->nd", y_NKD, weights_NK.astype(dt))

    def __call__(self, x_BTD: jax.Array, *, dropless: bool | None = None,
                 valid_BT: jax.Array | None = None, routing_BTK: jax.Array | None = None,
                 replay: bool = False) -> tuple[jax.Array, dict]:
        """Returns (y [B,T,D], aux) with aux = load_balance_loss, router_z_loss,
        dropped_fraction and `experts` (this router's top-k ids [B,T,k]).
        `dropless=None` follows `model.moe.dispatch`; `valid_BT` (bool) marks real
        tokens, the rest are padding (see module docstring). `routing_BTK`: the
        experts a rollout recorded (>= E: none recorded), replayed if `replay`;
        aux then also counts the tokens whose own top-k agrees with the record
        (`agreeing`, `recorded`). Under replay the load-balancing loss counts the
        replayed assignments against this router's probabilities."""
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        valid_N = None if valid_BT is None else valid_BT.reshape(B * T)
        logits_NE = jnp.einsum("nd,de->ne", x_ND.astype(jnp.float32),
                               self.router[...].astype(jnp.float32))
        recorded_NK = None if routing_BTK is None else routing_BTK.reshape(B * T, -1)
        replay_NK = recorded_NK if replay else None
        experts_NK, weights_NK, probs_NE = route(logits_NE, self.top_k, self.normalize,
                                                 replay_NK)
        own_NK = experts_NK if replay_NK is None else jax.lax.top_k(probs_NE, self.top_k)[1]
        aux = {"load_balance_loss": load_balance_loss(experts_NK, probs_NE, valid_N),
               "router_z_loss": router_z_loss(logits_NE, valid_N),
               "experts": own_NK.reshape(B, T, -1)}
        counted_N = valid_N
        if recorded_NK is not None:
            aux["agreeing"], aux["recorded"] = routing_agreement(
                own_NK, recorded_NK, self.num_experts, valid_N)
            counted_N = recorded_tokens(recorded_NK, self.num_experts, valid_N)
        # This router's assignments per expert (over the recorded tokens when there are
        # records, to compare with the rollout's load on the same tokens).
        aux["expert_load"] = expert_counts(own_NK, self.num_experts, counted_N)
        if dropless is None:
            dropless = not self.capacity_dispatch
        if dropless:
            y_ND = self._dropless(x_ND, experts_NK, weights_NK, valid_N)
            aux["dropped_fraction"] = jnp.zeros((), jnp.float32)
        else:
            if self.capacity_factor is None:
                raise ValueError("capacity dispatch needs model.moe.capacity_factor")
            cap = capacity(B * T, self.top_k, self.num_experts, self.capacity_factor)
            dispatch, combine, dropped = capacity_dispatch(experts_NK, weights_NK,
                                                           self.num_experts, cap, valid_N)
            x_ECD = jnp.einsum("nec,nd->ecd", dispatch.astype(self.dtype), x_ND)
            x_ECD = constrain(x_ECD, ("expert", None, "embed"))
            y_ECD = self._experts(x_ECD)
            y_ND = jnp.einsum("nec,ecd->nd", combine.astype(self.dtype), y_ECD)
            aux["dropped_fraction"] = dropped
        y = y_ND.reshape(B, T, D)
        if self.shared is not None:
            y = y + self.shared(x_BTD)
        return constrain(y, ("batch", "length", "embed")), aux
