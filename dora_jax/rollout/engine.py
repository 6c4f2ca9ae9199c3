"""Decode engine with JetStream's Engine API, native, plus per-token log-probs.

Same method names and meanings as `jetstream.engine.engine_api.Engine`:
`load_params`, `init_decode_state`, `prefill`, `insert`, `generate`,
`max_concurrent_decodes`, `max_prefill_length`, `samples_per_slot`, `mesh`. Params are
an argument of every prefill and generate call; the engine holds none, so one engine
serves any param version and several versions coexist as several pytrees.

Life of a request in slot s:
  prefix, first = prefill(params=p, padded_tokens=..., true_length=P, rng=key)
      -> KV cache of the prompt and response token 0 (sampled from the last logits)
  state = insert(prefix, state, s)
  state, result = generate(p, state)     # every slot: n more tokens, until finished
Token n of a response is sampled with fold_in(request_key, n) (see sampling.py).

`generate` advances every active slot by up to `rollout.decode_steps` tokens in one
dispatch (a `lax.while_loop` of the decode step on device, EOS / max-length masking
on device) and returns all of them in one array, so the host syncs once per call.
The call ends early, after the step in which some slot finishes, so that its slot
can be refilled at once: the host never decodes a freed slot empty for the rest of a
call, and finish positions are token-exact. `max_steps` caps a call below
`decode_steps` without recompiling (a slice with free slots asks for one token).

Compiled functions: prefill, insert and extract once per padded length bucket,
extension of a prefix once per (chunk, prefix, result) bucket, generate once (paged
cache: once per bucket of mapped pages). Prefill buckets cover prompts
(`rollout.prefill_buckets`) and, for re-prefill of prompt + tokens so far (partial
rollout, preemption), doubling buckets up to `rollout.cache_length`
(`prefill_buckets`).

KV cache (`rollout.kv_cache`): "dense" gives every slot cache_length positions;
"paged" keeps a pool of pages (`pages.PagePool`, host-side, one decode state per
engine) and decode attention reads only each slot's pages (paged_attention.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dora_jax.buckets import doubling_buckets, pick_bucket
from dora_jax.config import DECODE_RULES, ModelConfig, RolloutConfig
from dora_jax.model import transformer
from dora_jax.model.paged_attention import POOL_AXES
from dora_jax.model.sharding import activation_rules, logical_to_spec, param_shardings
from dora_jax.rollout import sampling
from dora_jax.rollout.pages import PagePool
from dora_jax.rollout.state import DecodeState, EngineParams, Prefix, ResultTokens
from dora_jax.rollout.sampling import SamplingParams

if TYPE_CHECKING:  # the tokenizer's libraries load only when a tokenizer is asked for
    from dora_jax.data.tokenizer import Tokenizer, TokenizerParameters


def _leaf_paths(params) -> list:
    """Leaf paths of an nnx.State or of its pure-dict form, alike."""
    return [jax.tree_util.keystr(p).removesuffix(".value")
            for p, _ in jax.tree_util.tree_leaves_with_path(params)]


def prefill_buckets(rollout: RolloutConfig) -> tuple:
    """Padded prefill lengths: the prompt buckets, then doubling buckets up to
    cache_length for re-prefilling prompt + tokens so far."""
    return doubling_buckets(rollout.prefill_buckets, rollout.cache_length)


class Engine:
    """JetStream-style engine for one decode slice's mesh.

    Args:
      model_cfg, rollout_cfg: validated model and rollout settings (slots, lengths,
        sampling, eos). `rollout_cfg.eos_id < 0` disables EOS (benchmarks).
      mesh: the slice's device mesh (axes `tensor`, `expert`).
      rules: logical-axis rules for params, activations and the KV cache.
      sampling_params: overrides the sampling settings of `rollout_cfg`;
        `greedy=True` is a shortcut for argmax decoding.
    """

    def __init__(self, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, mesh: Mesh, *,
                 rules=DECODE_RULES, sampling_params: SamplingParams | None = None,
                 greedy: bool = False, tokenizer_path: str | None = None):
        self.model_cfg, self.rollout_cfg, self._mesh = model_cfg, rollout_cfg, mesh
        self.tokenizer_path = tokenizer_path
        self.rules = tuple(rules)
        sp = sampling_params or SamplingParams.from_rollout(rollout_cfg)
        self.sampling_params = SamplingParams(sp.temperature, sp.top_k, sp.top_p,
                                              greedy or sp.greedy)
        self.buckets = prefill_buckets(rollout_cfg)  # padded prefill lengths
        self.graphdef, abstract = transformer.abstract_params(model_cfg)
        leaves, self._treedef = jax.tree.flatten(abstract)
        self._paths = _leaf_paths(abstract)
        self._leaf_shapes = [(x.shape, x.dtype) for x in leaves]
        self._param_sh = EngineParams(tuple(jax.tree.leaves(
            param_shardings(abstract, mesh, self.rules))))
        # Paged KV: the host-side page tables of this engine's decode state.
        self.pages = (PagePool(rollout_cfg.pool_pages, rollout_cfg.page_size,
                               rollout_cfg.slots_per_slice, rollout_cfg.cache_length)
                      if rollout_cfg.kv_cache == "paged" else None)
        rep = NamedSharding(mesh, PartitionSpec())

        def kv_sharding(axes):
            sh = NamedSharding(mesh, logical_to_spec(axes, self.rules, mesh))
            return transformer.KVCache(sh, sh)

        prefix_kv_sh = kv_sharding(transformer.CACHE_AXES)
        state_kv_sh = prefix_kv_sh if self.pages is None else kv_sharding(POOL_AXES)
        self._state_sh = DecodeState(state_kv_sh, *[rep] * 6)
        self._prefix_sh = Prefix(prefix_kv_sh, *[rep] * 7)
        res_sh = ResultTokens(rep)
        self._prefill_jit = jax.jit(
            self._prefill_fn, in_shardings=(self._param_sh, rep, rep, rep, rep, rep),
            out_shardings=(self._prefix_sh, res_sh))
        # The paged variants take the slot's pages (insert, extract) and the page view
        # (generate) as one more argument; for the dense cache it is None.
        self._insert_jit = jax.jit(
            self._insert_fn, donate_argnums=(1,),
            in_shardings=(self._prefix_sh, self._state_sh, rep, rep),
            out_shardings=self._state_sh)
        self._generate_jit = jax.jit(
            self._generate_steps_fn, donate_argnums=(1,),
            in_shardings=(self._param_sh, self._state_sh, rep, rep),
            out_shardings=(self._state_sh, res_sh))
        self._init_jit = jax.jit(self._init_fn, out_shardings=self._state_sh)
        self._extract_jit = jax.jit(self._extract_fn, static_argnums=(3,),
                                    in_shardings=(self._state_sh, rep, rep),
                                    out_shardings=self._prefix_sh)
        self._extend_jit = jax.jit(
            self._extend_fn, static_argnums=(7,),
            in_shardings=(self._param_sh, self._prefix_sh, rep, rep, rep, rep, rep),
            out_shardings=(self._prefix_sh, res_sh))
        self._resample_jit = jax.jit(self._resample_fn,
                                     in_shardings=(self._prefix_sh, rep, rep, rep),
                                     out_shardings=(self._prefix_sh, res_sh))

    # ------------------------------------------------------------ Engine API

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @property
    def max_concurrent_decodes(self) -> int:
        """Number of slots S."""
        return self.rollout_cfg.slots_per_slice

    @property
    def max_prefill_length(self) -> int:
        """Longest prompt (re-prefill of prompt + tokens so far may be longer)."""
        return self.rollout_cfg.max_prefill_length

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_decode_len(self) -> int:
        return self.rollout_cfg.max_decode_len

    @property
    def decode_steps(self) -> int:
        """Tokens per slot per `generate` call."""
        return self.rollout_cfg.decode_steps

    @property
    def cache_length(self) -> int:
        return self.rollout_cfg.cache_length

    def get_tokenizer(self) -> TokenizerParameters:
        """Engine API: where this engine's tokenizer lives (its checkpoint directory)."""
        if self.tokenizer_path is None:
            raise ValueError("this engine was built without a tokenizer_path")
        from dora_jax.data.tokenizer import TokenizerParameters
        return TokenizerParameters(self.tokenizer_path)

    def build_tokenizer(self, metadata: TokenizerParameters) -> Tokenizer:
        """Engine API: the tokenizer that `metadata` (from `get_tokenizer`) describes."""
        from dora_jax.data.tokenizer import Tokenizer
        return Tokenizer.from_pretrained(metadata.path)

    def load_params(self, params) -> EngineParams:
        """Reshards `params` (the model's param nnx.State, or its pure dict, on any
        devices — e.g. the trainer mesh — or EngineParams) onto this engine's mesh
        with the decode rules. Returns EngineParams."""
        if isinstance(params, EngineParams):
            leaves = list(params.leaves)
            paths = self._paths if len(leaves) == len(self._paths) else None
        else:
            leaves, paths = jax.tree.leaves(params), _leaf_paths(params)
        if paths != self._paths:
            diff = sorted(set(paths or ()) ^ set(self._paths))[:3]
            raise ValueError("load_params: params do not have this model's structure "
                             f"({len(leaves)} leaves, expected {len(self._paths)}; "
                             f"differing paths e.g. {diff})")
        for i, (x, (shape, dtype)) in enumerate(zip(leaves, self._leaf_shapes)):
            if x.shape != shape or x.dtype != dtype:
                raise ValueError(f"load_params: leaf {i} is {x.dtype}{list(x.shape)}, the "
                                 f"model expects {dtype}{list(shape)}")
        return EngineParams(tuple(jax.device_put(leaves, list(self._param_sh.leaves))))

    def init_decode_state(self) -> DecodeState:
        """Empty decode state: S inactive slots, zero KV cache (paged: every page
        free — the engine's page tables describe one decode state at a time)."""
        if self.pages is not None:
            self.pages.reset()
        return self._init_jit()

    @property
    def colocated_cpus(self):
        """Engine API: host CPUs colocated with the slice's devices; none are assigned."""
        return None

    def free_resource(self, slot: int) -> None:
        """Engine API: releases the slot's KV pages (paged cache; nothing to do for
        the dense one). The slot stops decoding at the next generate call."""
        if self.pages is not None:
            self.pages.release(slot)

    def prefill(self, *, params: EngineParams, padded_tokens, true_length: int, rng=None,
                num_generated: int = 0, existing_prefix: Prefix | None = None,
                max_new_tokens: int | None = None):
        """Runs tokens through the model and samples the next one. Returns (Prefix,
        ResultTokens with B=1).

        Without `existing_prefix`: the prompt (or prompt + response tokens so far,
        re-prefill) from position 0. With it (a Prefix this engine computed, e.g. the
        prompt of the request's group), as in JetStream's API the tokens are appended
        to the text it represents: they attend to its KV and only they run (chunked
        prefill; the caller makes sure the whole fits `cache_length`). With no new
        tokens (`true_length=0`: another sample of the same prompt) nothing runs and
        the token is drawn from the prefix's logits with this request's rng.

        padded_tokens: int[T] with T one of `self.buckets` (see `pad_tokens`); the
          first `true_length` are real.
        rng: the request's RNG seed (int) or uint32[2] key data; may be omitted only
          in greedy mode.
        num_generated: response tokens before the one to sample (among the tokens
          given, or the prefix's); the sampled token is response token `num_generated`.
        max_new_tokens: the request's response-length limit (at most, and by
          default, `max_decode_len`).
        """
        tokens_T = np.asarray(padded_tokens, np.int32)
        if tokens_T.ndim != 1 or tokens_T.shape[0] not in self.buckets:
            raise ValueError(f"prefill: padded_tokens must be 1-D with length in "
                             f"{self.buckets}, got shape {tokens_T.shape}")
        if not 0 <= num_generated < self.max_decode_len:
            raise ValueError(f"prefill: num_generated must be in [0, max_decode_len="
                             f"{self.max_decode_len}), got {num_generated}")
        if not 0 <= true_length <= tokens_T.shape[0]:
            raise ValueError(f"prefill: true_length ({true_length}) must be in [0, padded "
                             f"length ({tokens_T.shape[0]})]")
        prompt_len = true_length - num_generated
        if existing_prefix is None and not 1 <= prompt_len <= self.max_prefill_length:
            raise ValueError(f"prefill: need 1 <= prompt length ({prompt_len}) <= "
                             f"max_prefill_length ({self.max_prefill_length})")
        if rng is None and not self.sampling_params.greedy:
            raise ValueError("prefill: a per-request rng is required when sampling")
        key = sampling.key_data_from_seed(0 if rng is None else rng)
        limit = np.int32(min(max_new_tokens or self.max_decode_len, self.max_decode_len))
        if limit <= num_generated:
            raise ValueError(f"prefill: max_new_tokens ({max_new_tokens}) must exceed "
                             f"num_generated ({num_generated})")
        if existing_prefix is None:
            return self._prefill_jit(params, tokens_T, np.int32(true_length), key,
                                     np.int32(num_generated), limit)
        if true_length == 0:
            return self._resample_jit(existing_prefix, key, np.int32(num_generated), limit)
        # The result's bucket: room for the prefix's and the chunk's padded lengths.
        room = existing_prefix.cache.length + tokens_T.shape[0]
        length = (self.cache_length if room >= self.cache_length
                  else pick_bucket(room, self.buckets, "prefill buckets"))
        return self._extend_jit(params, existing_prefix, tokens_T, np.int32(true_length), key,
                                np.int32(num_generated), limit, length)

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, *,
               length: int | None = None, shared_pages=()) -> DecodeState:
        """Places a prefix in `slot` (donates `decode_state`). The prefix must be on
        this engine's mesh (`jax.device_put(prefix, get_prefix_destination_sharding())`).

        Paged cache: the slot's previous pages are released and it gets pages for
        `length` positions (the prefix's written positions; default its whole
        length), the first of them `shared_pages` (`pages.share`: another slot's
        prompt pages, mapped, not copied). Raises PagesExhausted if the pool is short.
        """
        if not 0 <= slot < self.max_concurrent_decodes:
            raise ValueError(f"insert: slot {slot} out of range [0, "
                             f"{self.max_concurrent_decodes})")
        if prefix.cache.length > self.cache_length:
            raise ValueError(f"insert: prefix of length {prefix.cache.length} exceeds "
                             f"cache_length {self.cache_length}")
        write = None
        if self.pages is not None:
            length = prefix.cache.length if length is None else length
            if not 0 < length <= prefix.cache.length:
                raise ValueError(f"insert: length {length} outside the prefix's "
                                 f"(1..{prefix.cache.length})")
            write = np.zeros(self.pages.pages_for(prefix.cache.length), np.int32)
            assigned = self.pages.assign(slot, length, shared_pages)
            write[:len(assigned)] = assigned
        return self._insert_jit(prefix, decode_state, np.int32(slot), write)

    def generate(self, params: EngineParams, decode_state: DecodeState,
                 max_steps: int | None = None):
        """Up to `decode_steps` (or `max_steps`, if fewer) decode steps for every slot
        in one dispatch, ending after the first step in which a slot finishes
        (donates `decode_state`). Paged cache: first maps the pages the call may
        write (PagesExhausted if the pool is short: see `pages.shortfall`). Returns (new DecodeState, ResultTokens of
        [decode_steps, S, 6]; rows of steps not run are not valid)."""
        n = self.decode_steps if max_steps is None else min(max_steps, self.decode_steps)
        view = None
        if self.pages is not None:
            self.pages.advance(n)  # pages for every position this call may write
            view = self.pages.view()
        return self._generate_jit(params, decode_state, np.int32(n), view)

    def get_prefix_destination_sharding(self) -> Prefix:
        return self._prefix_sh

    # ----------------------------------------------------------- extensions

    def extract(self, decode_state: DecodeState, slot: int, used: int | None = None) -> Prefix:
        """A slot's decode state as a Prefix (next input token, position, RNG key,
        step, and its KV cache): what migration moves. With `used` (positions
        written so far, prompt + response), only the smallest bucket holding them is
        moved rather than the whole cache_length."""
        if not 0 <= slot < self.max_concurrent_decodes:
            raise ValueError(f"extract: slot {slot} out of range")
        length = self.cache_length if used is None else pick_bucket(
            used, self.buckets + (self.cache_length,), "extract buckets")
        pages = None
        if self.pages is not None:
            pages = self.pages.table[slot, :self.pages.pages_for(length)].copy()
        return self._extract_jit(decode_state, np.int32(slot), pages, length)

    def pad_tokens(self, tokens) -> tuple[np.ndarray, int]:
        """(tokens padded with pad_id to their bucket, true length)."""
        tokens = np.asarray(tokens, np.int32)
        padded = np.full(pick_bucket(len(tokens), self.buckets, "prefill buckets"),
                         self.rollout_cfg.pad_id, np.int32)
        padded[:len(tokens)] = tokens
        return padded, len(tokens)

    # --------------------------------------------------- pure (traced) functions

    def _params(self, params: EngineParams):
        return jax.tree.unflatten(self._treedef, list(params.leaves))

    def _finished(self, tokens_B, steps_B, limits_B):
        # steps_B is the index of the token just sampled: index limit-1 is the last.
        return (tokens_B == self.rollout_cfg.eos_id) | (steps_B + 1 >= limits_B)

    def _init_fn(self):
        S = self.max_concurrent_decodes
        if self.pages is None:
            cache = transformer.init_cache(self.model_cfg, S, self.cache_length)
        else:
            cache = transformer.init_pool(self.model_cfg, self.pages.num_pages + 1,
                                          self.pages.page_size)
        return DecodeState(cache, jnp.zeros(S, jnp.int32), jnp.zeros(S, jnp.int32),
                           jnp.zeros(S, jnp.int32), jnp.zeros((S, 2), jnp.uint32),
                           jnp.zeros(S, bool), jnp.zeros(S, jnp.int32))

    def _prefill_fn(self, params, tokens_T, true_length, key, num_generated, limit):
        with activation_rules(self._mesh, self.rules):
            logits_1TV, _, kv = transformer.apply(
                self.graphdef, self._params(params), tokens_T[None], dropless=True,
                return_kv=True)
        dtype = jnp.dtype(self.model_cfg.dtype)
        kv = jax.tree.map(lambda x: x.astype(dtype), kv)
        logits_1V = jax.lax.dynamic_slice_in_dim(logits_1TV[0], true_length - 1, 1, axis=0)
        return self._first_token(kv, logits_1V, true_length, key, num_generated, limit)

    def _extend_fn(self, params, prefix: Prefix, chunk_C, count, key, num_generated, limit,
                   length: int):
        """Prefill of `count` tokens (chunk_C, padded) after the prefix's positions,
        attending to them; the result's KV has `length` positions."""
        held = prefix.position
        with activation_rules(self._mesh, self.rules):
            logits_1CV, _, kv = transformer.apply(
                self.graphdef, self._params(params), chunk_C[None], dropless=True,
                return_kv=True, past=prefix.cache, past_length=held)
        C, T0 = chunk_C.shape[0], prefix.cache.length

        def assemble(old, new):  # room for the whole chunk wherever it starts, then cut
            buf = jnp.zeros((*old.shape[:2], max(T0, length) + C, *old.shape[3:]), old.dtype)
            buf = jax.lax.dynamic_update_slice_in_dim(buf, old, 0, axis=2)
            buf = jax.lax.dynamic_update_slice_in_dim(buf, new.astype(old.dtype), held, axis=2)
            return buf[:, :, :length]

        kv = jax.tree.map(assemble, prefix.cache, kv)
        logits_1V = jax.lax.dynamic_slice_in_dim(logits_1CV[0], count - 1, 1, axis=0)
        return self._first_token(kv, logits_1V, held + count, key, num_generated, limit)

    def _first_token(self, kv, logits_1V, true_length, key, num_generated, limit):
        """Samples the token after a prefill; (Prefix, ResultTokens)."""
        step_1 = num_generated[None]
        token_1, logprob_1 = sampling.sample(logits_1V, sampling.step_keys(key[None], step_1),
                                             self.sampling_params)
        finished_1 = self._finished(token_1, step_1, limit)
        prefix = Prefix(kv, token_1[0], true_length, num_generated + 1, key, ~finished_1[0],
                        limit, logits_1V[0].astype(jnp.float32))
        result = ResultTokens.pack(token_1, logprob_1, true_length[None], step_1,
                                   jnp.ones(1, bool), finished_1)
        return prefix, result

    def _insert_fn(self, prefix: Prefix, state: DecodeState, slot, write_pages):
        def put_dense(cache_LSCKD, new_L1TKD):
            return jax.lax.dynamic_update_slice(
                cache_LSCKD, new_L1TKD.astype(cache_LSCKD.dtype), (0, slot, 0, 0, 0))

        def put_paged(pool_LKPpD, new_L1TKD):
            # Chunk j of the prefix goes to page write_pages[j] (0: the null page, for
            # shared and unused chunks).
            L, _, T, K, D = new_L1TKD.shape
            n, ps = write_pages.shape[0], pool_LKPpD.shape[3]
            x = jnp.pad(new_L1TKD[:, 0], ((0, 0), (0, n * ps - T), (0, 0), (0, 0)))
            x_LKnpD = x.reshape(L, n, ps, K, D).transpose(0, 3, 1, 2, 4)
            return pool_LKPpD.at[:, :, write_pages].set(x_LKnpD.astype(pool_LKPpD.dtype))

        put = put_dense if write_pages is None else put_paged
        cache = jax.tree.map(put, state.cache, prefix.cache)
        return DecodeState(cache, state.tokens.at[slot].set(prefix.token),
                           state.positions.at[slot].set(prefix.position),
                           state.steps.at[slot].set(prefix.step),
                           state.keys.at[slot].set(prefix.key),
                           state.active.at[slot].set(prefix.active),
                           state.limits.at[slot].set(prefix.limit))

    def _extract_fn(self, state: DecodeState, slot, pages, length: int):
        def take_dense(c):
            return jax.lax.dynamic_slice_in_dim(c, slot, 1, axis=1)[:, :, :length]

        def take_paged(pool_LKPpD):
            x_LKnpD = pool_LKPpD[:, :, pages]
            L, K, n, ps, D = x_LKnpD.shape
            return x_LKnpD.transpose(0, 2, 3, 1, 4).reshape(L, 1, n * ps, K, D)[:, :, :length]

        cache = jax.tree.map(take_dense if pages is None else take_paged, state.cache)
        return Prefix(cache, state.tokens[slot], state.positions[slot], state.steps[slot],
                      state.keys[slot], state.active[slot], state.limits[slot],
                      jnp.zeros(self.model_cfg.vocab_size, jnp.float32))

    def _resample_fn(self, prefix: Prefix, key, num_generated, limit):
        """The first token of another sample of `prefix`'s prompt, from its logits."""
        step_1 = num_generated[None]
        token_1, logprob_1 = sampling.sample(prefix.logits[None],
                                             sampling.step_keys(key[None], step_1),
                                             self.sampling_params)
        finished_1 = self._finished(token_1, step_1, limit)
        result = ResultTokens.pack(token_1, logprob_1, prefix.position[None], step_1,
                                   jnp.ones(1, bool), finished_1)
        return prefix._replace(token=token_1[0], step=num_generated + 1, key=key,
                               active=~finished_1[0], limit=limit), result

    def _generate_steps_fn(self, params: EngineParams, state: DecodeState, max_steps, view):
        n, S = self.decode_steps, self.max_concurrent_decodes

        def cond(carry):
            state, i, _, any_finished = carry
            return (i < max_steps) & ~any_finished & jnp.any(state.active)

        def body(carry):
            state, i, data_NS6, _ = carry
            state, result = self.generate_fn(params, state, view)
            data_NS6 = jax.lax.dynamic_update_slice_in_dim(data_NS6, result.data[None], i, 0)
            return state, i + 1, data_NS6, jnp.any(result.finished)

        # Rows of steps not run stay zero: not valid.
        init = (state, jnp.int32(0), jnp.zeros((n, S, 6), jnp.int32), jnp.bool_(False))
        state, _, data_NS6, _ = jax.lax.while_loop(cond, body, init)
        return state, ResultTokens(data_NS6)

    def generate_fn(self, params: EngineParams, state: DecodeState, view=None):
        """The pure decode step behind `generate` (for use inside other jitted code,
        e.g. a while_loop sampler). Paged cache: `view` is `self.pages.view()`, with
        pages for every position the step writes; slots without pages are idle."""
        with activation_rules(self._mesh, self.rules):
            logits_SV, cache = transformer.decode(
                self.graphdef, self._params(params), state.tokens, state.positions,
                state.cache, view, self.rollout_cfg.paged_attention)
        tokens_S, logprobs_S = sampling.sample(
            logits_SV, sampling.step_keys(state.keys, state.steps), self.sampling_params)
        active_S = state.active if view is None else state.active & view.owned
        finished_S = active_S & self._finished(tokens_S, state.steps, state.limits)
        inc_S = active_S.astype(jnp.int32)
        # Inactive slots keep their token and position: their (ignored) decode just
        # rewrites one cache entry of their own (dense) or of the null page (paged).
        new_state = DecodeState(cache, jnp.where(active_S, tokens_S, state.tokens),
                                state.positions + inc_S, state.steps + inc_S, state.keys,
                                active_S & ~finished_S, state.limits)
        result = ResultTokens.pack(tokens_S, logprobs_S, state.positions + 1, state.steps,
                                   active_S, finished_S)
        return new_state, result
