"""The engine's device programs: pure functions of params and pytrees, jitted with a
slice's shardings by `jit_programs` (`Engine.generate_fn` exposes the step for other
jitted loops).

Stopping: a sequence finishes on the token after which it has `limit` response
tokens, or on any of the engine's stop ids (a tokenizer may carry several).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dora_jax.model import lora, transformer
from dora_jax.model.paged_attention import POOL_AXES
from dora_jax.model.sharding import Rules, activation_rules, logical_to_spec
from dora_jax.rollout import sampling
from dora_jax.rollout.pages import PageView
from dora_jax.rollout.routing import not_routed, routing_dtype
from dora_jax.rollout.state import DecodeState, EngineParams, Prefix, ResultTokens

if TYPE_CHECKING:
    from dora_jax.config import ModelConfig, RolloutConfig

# What prefill / extend / resample give: the prompt's prefix and its first tokens.
Prefilled = tuple[Prefix, ResultTokens]


# The decode loop's carry: the state, the steps run, the results so far, whether a
# slot finished.
_Carry = tuple[DecodeState, jax.Array, ResultTokens, jax.Array]


class Programs:
    """What the engine runs on device, for one model, mesh and sampling setting.

    stop_ids: token ids that end a sequence (none: only the length limit does).
    pool_pages: pages of the paged KV pool (page 0 excluded), or None for the
      dense cache.
    """

    def __init__(self, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, mesh: Mesh,
                 rules: Rules, sampling_params: sampling.SamplingParams,
                 graphdef: nnx.GraphDef, treedef: jax.tree_util.PyTreeDef, *,
                 stop_ids: Sequence[int], pool_pages: int | None) -> None:
        self.model_cfg, self.rollout_cfg, self.mesh, self.rules = (model_cfg, rollout_cfg,
                                                                   mesh, rules)
        self.sampling_params, self.graphdef, self.treedef = sampling_params, graphdef, treedef
        self.stop_ids, self.pool_pages = np.asarray(sorted(stop_ids), np.int32), pool_pages
        # MoE: every generate step reports the experts its input token went through.
        m = model_cfg.moe
        self.routing = None if not m.enabled else (
            routing_dtype(m.num_experts), not_routed(m.num_experts),
            model_cfg.num_moe_layers, m.top_k)

    def _params(self, params: EngineParams) -> nnx.State:
        return jax.tree.unflatten(self.treedef, list(params.leaves))

    @contextlib.contextmanager
    def _tracing(self, params: EngineParams) -> Iterator[None]:
        """The model's call: activations sharded by the rules; with stacked adapters,
        each row under its place (model/lora.py's `rows`)."""
        with activation_rules(self.mesh, self.rules), contextlib.ExitStack() as stack:
            if params.rows is not None:
                stack.enter_context(lora.rows(params.rows))
            yield

    def finished(self, tokens_B: jax.Array, steps_B: jax.Array, limits_B: jax.Array
                 ) -> jax.Array:
        """steps_B: the response index of each token just sampled."""
        stop_B = (jnp.isin(tokens_B, self.stop_ids) if self.stop_ids.size
                  else jnp.zeros(tokens_B.shape, bool))
        return stop_B | (steps_B + 1 >= limits_B)

    def init(self) -> DecodeState:
        r, S = self.rollout_cfg, self.rollout_cfg.slots_per_slice
        if self.pool_pages is None:
            cache = transformer.init_cache(self.model_cfg, S, r.cache_length)
        else:
            cache = transformer.init_pool(self.model_cfg, self.pool_pages + 1, r.page_size)
        return DecodeState(cache, jnp.zeros(S, jnp.int32), jnp.zeros(S, jnp.int32),
                           jnp.zeros(S, jnp.int32), jnp.zeros((S, 2), jnp.uint32),
                           jnp.zeros(S, bool), jnp.zeros(S, jnp.int32))

    def prefill(self, params: EngineParams, tokens_T: jax.Array, true_length: jax.Array,
                keys_N2: jax.Array, num_generated: jax.Array, limit: jax.Array) -> Prefilled:
        """A prompt (+ tokens so far) from position 0; N first tokens, one per key."""
        with self._tracing(params):
            logits_1TV, _, kv = transformer.apply(
                self.graphdef, self._params(params), tokens_T[None], dropless=True,
                return_kv=True)
        dtype = jnp.dtype(self.model_cfg.dtype)
        kv = jax.tree.map(lambda x: x.astype(dtype), kv)
        logits_1V = jax.lax.dynamic_slice_in_dim(logits_1TV[0], true_length - 1, 1, axis=0)
        return self._first_tokens(kv, logits_1V, true_length, keys_N2, num_generated, limit)

    def extend(self, params: EngineParams, prefix: Prefix, chunk_C: jax.Array, count: jax.Array,
               keys_N2: jax.Array, num_generated: jax.Array, limit: jax.Array,
               length: int) -> Prefilled:
        """Prefill of `count` tokens (chunk_C, padded) after the prefix's positions,
        attending to them; the result's KV has `length` positions."""
        held = prefix.position
        with self._tracing(params):
            logits_1CV, _, kv = transformer.apply(
                self.graphdef, self._params(params), chunk_C[None], dropless=True,
                return_kv=True, past=prefix.cache, past_length=held)
        C, T0 = chunk_C.shape[0], prefix.cache.length

        # room for the whole chunk wherever it starts, then cut
        def assemble(old: jax.Array, new: jax.Array) -> jax.Array:
            buf = jnp.zeros((*old.shape[:2], max(T0, length) + C, *old.shape[3:]), old.dtype)
            buf = jax.lax.dynamic_update_slice_in_dim(buf, old, 0, axis=2)
            buf = jax.lax.dynamic_update_slice_in_dim(buf, new.astype(old.dtype), held, axis=2)
            return buf[:, :, :length]

        kv = jax.tree.map(assemble, prefix.cache, kv)
        logits_1V = jax.lax.dynamic_slice_in_dim(logits_1CV[0], count - 1, 1, axis=0)
        return self._first_tokens(kv, logits_1V, held + count, keys_N2, num_generated, limit)

    def extend_many(self, params: EngineParams, prefixes: tuple[Prefix, ...],
                    chunks_BC: jax.Array, counts_B: jax.Array, keys_BN2: jax.Array,
                    num_generated_B: jax.Array, limits_B: jax.Array, length: int
                    ) -> tuple[tuple[Prefix, ...], tuple[ResultTokens, ...]]:
        """`extend` of each row (prefix i, chunk i, ...) in one batched forward; returns
        (a Prefix per row, a ResultTokens per row). The prefixes share a cache length."""
        B, C = chunks_BC.shape
        past = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1),
                            *[p.cache for p in prefixes])
        held_B = jnp.stack([p.position for p in prefixes])
        with self._tracing(params):
            logits_BCV, _, kv = transformer.apply(
                self.graphdef, self._params(params), chunks_BC, dropless=True,
                return_kv=True, past=past, past_length=held_B)
        T0 = past.length

        # one row: room for the chunk, then cut
        def assemble(old_1: jax.Array, new_1: jax.Array, held: jax.Array) -> jax.Array:
            buf = jnp.zeros((old_1.shape[0], max(T0, length) + C, *old_1.shape[2:]),
                            old_1.dtype)
            buf = jax.lax.dynamic_update_slice_in_dim(buf, old_1, 0, axis=1)
            buf = jax.lax.dynamic_update_slice_in_dim(buf, new_1.astype(old_1.dtype), held,
                                                      axis=1)
            return buf[:, :length]

        rows = jax.vmap(assemble, in_axes=(1, 1, 0), out_axes=1)
        kv = jax.tree.map(lambda old, new: rows(old, new, held_B), past, kv)
        logits_BV = jnp.take_along_axis(logits_BCV, (counts_B - 1)[:, None, None], axis=1)[:, 0]
        out = []
        for i in range(B):
            cache_i = jax.tree.map(lambda x, i=i: x[:, i:i + 1], kv)
            out.append(self._first_tokens(cache_i, logits_BV[i:i + 1], held_B[i] + counts_B[i],
                                          keys_BN2[i], num_generated_B[i], limits_B[i]))
        return tuple(o[0] for o in out), tuple(o[1] for o in out)

    def resample(self, cache: transformer.KVCache, logits_V: jax.Array, position: jax.Array,
                 keys_N2: jax.Array, num_generated: jax.Array, limit: jax.Array) -> Prefilled:
        """N more samples of a prefix's text (its cache, logits and position, not its
        samples: a prefix of any number resamples with one program): first tokens from
        its logits."""
        return self._first_tokens(cache, logits_V[None], position, keys_N2, num_generated,
                                  limit)

    def _first_tokens(self, kv: transformer.KVCache, logits_1V: jax.Array,
                      true_length: jax.Array, keys_N2: jax.Array, num_generated: jax.Array,
                      limit: jax.Array) -> Prefilled:
        N = keys_N2.shape[0]
        step_N = jnp.full(N, num_generated, jnp.int32)
        logits_NV = jnp.broadcast_to(logits_1V, (N, logits_1V.shape[-1]))
        token_N, logprob_N = sampling.sample(logits_NV,
                                             sampling.step_uniforms(keys_N2, step_N),
                                             self.sampling_params)
        finished_N = self.finished(token_N, step_N, limit)
        prefix = Prefix(kv, token_N, true_length, num_generated + 1, keys_N2, ~finished_N,
                        limit, logits_1V[0].astype(jnp.float32))
        result = ResultTokens.pack(token_N, logprob_N, jnp.full(N, true_length), step_N + 1,
                                   jnp.ones(N, bool), finished_N)
        return prefix, result

    def insert(self, prefix: Prefix, state: DecodeState, slots_N: jax.Array,
               samples_N: jax.Array, write_pages_Nn: jax.Array | None) -> DecodeState:
        """Sample samples_N[i] of the prefix into slot slots_N[i], for each i in one
        call (a row may repeat another: same slot, same sample); paged: the prefix's
        chunk j of row i goes to page write_pages_Nn[i, j] (0, the null page, for
        shared and unused chunks)."""
        def put_dense(cache_SKCD: jax.Array, new_1TKD: jax.Array) -> jax.Array:
            new = new_1TKD.swapaxes(1, 2).astype(cache_SKCD.dtype)
            for i in range(slots_N.shape[0]):
                cache_SKCD = jax.lax.dynamic_update_slice(cache_SKCD, new, (slots_N[i], 0, 0, 0))
            return cache_SKCD

        def put_paged(pool_KPpD: jax.Array, new_1TKD: jax.Array) -> jax.Array:
            assert write_pages_Nn is not None  # chosen only with pages to write
            _, T, K, D = new_1TKD.shape
            (N, n), ps = write_pages_Nn.shape, pool_KPpD.shape[2]
            x = jnp.pad(new_1TKD[0], ((0, n * ps - T), (0, 0), (0, 0)))
            x_KnpD = x.reshape(n, ps, K, D).transpose(2, 0, 1, 3)
            x_KNnpD = jnp.broadcast_to(x_KnpD[:, None], (K, N, n, ps, D))
            return pool_KPpD.at[:, write_pages_Nn.reshape(-1)].set(
                x_KNnpD.reshape(K, N * n, ps, D).astype(pool_KPpD.dtype))

        put = put_dense if write_pages_Nn is None else put_paged
        cache = transformer.LayerCaches(
            tuple(put(c, prefix.cache.k[layer]) for layer, c in enumerate(state.cache.k)),
            tuple(put(c, prefix.cache.v[layer]) for layer, c in enumerate(state.cache.v)))
        return DecodeState(cache, state.tokens.at[slots_N].set(prefix.token[samples_N]),
                           state.positions.at[slots_N].set(prefix.position),
                           state.steps.at[slots_N].set(prefix.step),
                           state.keys.at[slots_N].set(prefix.key[samples_N]),
                           state.active.at[slots_N].set(prefix.active[samples_N]),
                           state.limits.at[slots_N].set(prefix.limit))

    def extract(self, state: DecodeState, slot: jax.Array, pages: jax.Array | None,
                length: int) -> Prefix:
        def take_dense(c_SKCD: jax.Array) -> jax.Array:
            row_1KCD = jax.lax.dynamic_slice_in_dim(c_SKCD, slot, 1, axis=0)
            return row_1KCD[:, :, :length].swapaxes(1, 2)

        def take_paged(pool_KPpD: jax.Array) -> jax.Array:
            x_KnpD = pool_KPpD[:, pages]
            K, n, ps, D = x_KnpD.shape
            return x_KnpD.transpose(1, 2, 0, 3).reshape(1, n * ps, K, D)[:, :length]

        take = take_dense if pages is None else take_paged
        cache = transformer.KVCache(jnp.stack([take(c) for c in state.cache.k]),
                                    jnp.stack([take(c) for c in state.cache.v]))
        return Prefix(cache, state.tokens[slot][None], state.positions[slot],
                      state.steps[slot], state.keys[slot][None], state.active[slot][None],
                      state.limits[slot], jnp.zeros(self.model_cfg.vocab_size, jnp.float32))

    def step(self, params: EngineParams, state: DecodeState, view: PageView | None = None
             ) -> tuple[DecodeState, ResultTokens]:
        """One decode step of every slot. Paged cache: `view` maps pages for every
        position the step writes; slots without pages are idle."""
        with self._tracing(params):
            logits_SV, cache, *experts = transformer.decode(
                self.graphdef, self._params(params), state.tokens, state.positions,
                state.cache, view, self.rollout_cfg.paged_attention,
                return_routing=self.routing is not None)
        tokens_S, logprobs_S = sampling.sample(
            logits_SV, sampling.step_uniforms(state.keys, state.steps), self.sampling_params)
        active_S = state.active if view is None else state.active & view.owned
        finished_S = active_S & self.finished(tokens_S, state.steps, state.limits)
        inc_S = active_S.astype(jnp.int32)
        # Inactive slots keep their token and position: their (ignored) decode just
        # rewrites one cache entry of their own (dense) or of the null page (paged).
        new_state = DecodeState(cache, jnp.where(active_S, tokens_S, state.tokens),
                                state.positions + inc_S, state.steps + inc_S, state.keys,
                                active_S & ~finished_S, state.limits)
        result = ResultTokens.pack(tokens_S, logprobs_S, state.positions + 1, state.steps + 1,
                                   active_S, finished_S)
        if self.routing is not None:
            dtype, none = self.routing[:2]
            result = result.replace(routing=jnp.where(
                active_S[:, None, None], experts[0].astype(dtype), jnp.asarray(none, dtype)))
        return new_state, result

    def steps(self, params: EngineParams, state: DecodeState, max_steps: jax.Array,
              view: PageView | None) -> tuple[DecodeState, ResultTokens]:
        """Up to `max_steps` (at most decode_steps) steps in a while_loop, ending after
        the first step in which a slot finishes; rows of steps not run stay zero."""
        n, S = self.rollout_cfg.decode_steps, self.rollout_cfg.slots_per_slice

        def cond(carry: _Carry) -> jax.Array:
            state, i, _, any_finished = carry
            return (i < max_steps) & ~any_finished & jnp.any(state.active)

        def body(carry: _Carry) -> _Carry:
            state, i, out, _ = carry
            state, result = self.step(params, state, view)
            out = jax.tree.map(
                lambda buf, new: jax.lax.dynamic_update_slice_in_dim(buf, new[None], i, 0),
                out, result)
            return state, i + 1, out, jnp.any(result.finished)

        routing = None
        if self.routing is not None:
            dtype, none, layers, k = self.routing
            routing = jnp.full((n, S, layers, k), none, dtype)
        init = (state, jnp.int32(0),
                ResultTokens(jnp.zeros((n, S, 6), jnp.int32), routing=routing),
                jnp.bool_(False))
        state, _, out, _ = jax.lax.while_loop(cond, body, init)
        return state, out


class Jitted(NamedTuple):
    """The programs jitted with the slice's shardings, the decode state donated."""

    prefill: Callable
    extend: Callable
    extend_many: Callable
    resample: Callable
    insert: Callable
    step: Callable
    steps: Callable
    init: Callable
    extract: Callable
    first_samples: Callable
    prefix_sharding: Prefix


def jit_programs(fn: Programs, mesh: Mesh, rules: Rules, param_sh: EngineParams, *,
                 paged: bool) -> Jitted:
    """`fn`'s programs jitted on `mesh`: params as placed (`param_sh`), the KV cache by
    `rules` (the paged pool's axes with `paged`), everything else replicated."""
    rep = NamedSharding(mesh, PartitionSpec())

    def sharding(axes: tuple[str | None, ...]) -> NamedSharding:
        return NamedSharding(mesh, logical_to_spec(axes, rules, mesh))

    sh = sharding(transformer.CACHE_AXES)
    prefix_kv_sh = transformer.KVCache(sh, sh)
    layer_sh = sharding(POOL_AXES if paged else transformer.LAYER_CACHE_AXES)
    layers = (layer_sh,) * fn.model_cfg.num_layers
    state_kv_sh = transformer.LayerCaches(layers, layers)
    state_sh = DecodeState(state_kv_sh, *[rep] * 6)
    prefix_sh = Prefix(prefix_kv_sh, *[rep] * 7)
    out = (prefix_sh, ResultTokens(rep))
    generated = ResultTokens(rep, routing=None if fn.routing is None else rep)
    # The paged variants take the slot's pages (insert, extract) and the page view
    # (generate) as one more argument; for the dense cache it is None.
    return Jitted(
        prefill=jax.jit(fn.prefill, in_shardings=(param_sh, *[rep] * 5), out_shardings=out),
        extend=jax.jit(fn.extend, static_argnums=(7,), out_shardings=out,
                       in_shardings=(param_sh, prefix_sh, *[rep] * 5)),
        extend_many=jax.jit(_rows_constrained(fn.extend_many, out), static_argnums=(7,)),
        resample=jax.jit(fn.resample, in_shardings=(prefix_kv_sh, *[rep] * 5),
                         out_shardings=out),
        insert=jax.jit(fn.insert, donate_argnums=(1,), out_shardings=state_sh,
                       in_shardings=(prefix_sh, state_sh, rep, rep, rep)),
        step=jax.jit(fn.step, donate_argnums=(1,), in_shardings=(param_sh, state_sh, rep),
                     out_shardings=(state_sh, generated)),
        steps=jax.jit(fn.steps, donate_argnums=(1,),
                      in_shardings=(param_sh, state_sh, rep, rep),
                      out_shardings=(state_sh, generated)),
        init=jax.jit(fn.init, out_shardings=state_sh),
        extract=jax.jit(fn.extract, static_argnums=(3,), out_shardings=prefix_sh,
                        in_shardings=(state_sh, rep, rep)),
        first_samples=jax.jit(_first_rows, static_argnums=(1,), out_shardings=rep),
        prefix_sharding=prefix_sh)


def _first_rows(rows: tuple[jax.Array, ...], n: int) -> tuple[jax.Array, ...]:
    return tuple(x[:n] for x in rows)


def first_samples(jitted: Jitted, prefilled: Prefilled, n: int) -> Prefilled:
    """The first `n` samples of a prefill that drew more: its per-sample rows, the
    prompt's cache as it is (not copied)."""
    prefix, result = prefilled
    token, key, active, data = jitted.first_samples(
        (prefix.token, prefix.key, prefix.active, result.data), n)
    return prefix._replace(token=token, key=key, active=active), result.replace(data=data)


def _rows_constrained(extend_many: Callable[..., tuple[tuple[Any, ...], tuple[Any, ...]]],
                      row_sharding: tuple[Prefix, ResultTokens]
                      ) -> Callable[..., tuple[tuple[Any, ...], tuple[Any, ...]]]:
    """`extend_many` with each row's outputs laid out as a single `extend`'s, which
    `insert` takes (the row count is only known when traced)."""
    def constrained(params: EngineParams, prefixes: tuple[Prefix, ...], *rest: Any
                    ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        prefixes_out, results_out = extend_many(params, prefixes, *rest)
        return (tuple(jax.lax.with_sharding_constraint(p, row_sharding[0]) for p in prefixes_out),
                tuple(jax.lax.with_sharding_constraint(r, row_sharding[1]) for r in results_out))
    return constrained


# A run's slices each have their own mesh, so their own entry. Kept small: every entry
# holds its compiled programs (memory, and the maps of their machine code).
@functools.lru_cache(maxsize=8)
def shared_programs(model_cfg: ModelConfig, rollout_cfg: RolloutConfig, mesh: Mesh,
                    rules: Rules, sampling_params: sampling.SamplingParams,
                    graphdef: nnx.GraphDef, treedef: jax.tree_util.PyTreeDef,
                    stop_ids: tuple[int, ...], pool_pages: int | None,
                    param_sh: EngineParams) -> tuple[Programs, Jitted]:
    """The programs of an engine of this config on `mesh`, jitted once per process: an
    engine made again with the same arguments (a slice restarted after a failure, the
    next run of a notebook or a test) reuses their traces and executables."""
    fn = Programs(model_cfg, rollout_cfg, mesh, rules, sampling_params, graphdef, treedef,
                  stop_ids=stop_ids, pool_pages=pool_pages)
    return fn, jit_programs(fn, mesh, rules, param_sh, paged=pool_pages is not None)
