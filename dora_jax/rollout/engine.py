"""Decode engine with JetStream's Engine API (`jetstream.engine.engine_api.Engine`),
plus per-token log-probs.

Params are an argument of every prefill and generate call; the engine holds none, so
one engine serves any version and several versions coexist as several pytrees.
Extensions to the API (keyword arguments with defaults, or methods of their own): per-
request `rng`, `num_generated` and `max_new_tokens` of prefill; `length` and
`shared_pages` of insert (paged cache); `generate_steps`; `prefill_continuations`
(several prefixes extended in one call); `extract` (a slot as a Prefix, for
migration); `pad_tokens`; `generate_fn` (the pure step).

`generate_steps` advances every active slot by up to `rollout.decode_steps` tokens in
one dispatch (a `lax.while_loop`, stop and length masks on device) and one host read;
it ends after the step in which some slot finishes, so the slot is refilled at once.

Programs compile once per padded length bucket: prompts use `rollout.prefill_buckets`,
re-prefills doubling buckets up to `rollout.cache_length`. `rollout.kv_cache`: "dense"
gives every slot cache_length positions; "paged" keeps a host-side pool of pages
(`pages.PagePool`) and decode attention reads only a slot's pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dora_jax.base.buckets import pick_bucket, prefill_buckets
from dora_jax.config import DECODE_RULES, ModelConfig, RolloutConfig
from dora_jax.model import layer_layout, paged_attention
from dora_jax.model.sharding import Rules
from dora_jax.rollout import jetstream_compat, prefill_args, sampling
from dora_jax.rollout.adapters import AdapterPlaces, check_versions
from dora_jax.rollout.pages import PagePool, PageView
from dora_jax.rollout.placement import ParamPlacement
from dora_jax.rollout.programs import first_samples, shared_programs
from dora_jax.rollout.sampling import SamplingParams, Seed
from dora_jax.rollout.state import DecodeState, EngineParams, Prefix, ResultTokens

if TYPE_CHECKING:  # the tokenizer's libraries load only when a tokenizer is asked for
    from dora_jax.text.serving_tokenizer import ServingTokenizer
    from dora_jax.text.tokenizer import TokenizerParameters


class Engine:
    """JetStream Engine for one decode slice's mesh.

    Args:
      model_cfg, rollout_cfg: validated model and rollout settings (slots, lengths,
        sampling, eos). `rollout_cfg.eos_id < 0` disables stop ids (benchmarks).
      mesh: the slice's device mesh (axes `tensor`, `expert`).
      rules: logical-axis rules for params, activations and the KV cache.
      sampling_params: overrides the sampling settings of `rollout_cfg`;
        `greedy=True` is a shortcut for argmax decoding.
      tokenizer_path: the tokenizer's directory (`get_tokenizer`).
      stop_ids: token ids that end a sequence; by default `rollout_cfg.eos_id` and
        the tokenizer's stop ids.
      versions: LoRA versions resident at once (rollout/adapters.py): with more than
        one, the programs take `places` stacks and each row's place (`with_rows`).
      checkpoint: a directory of saved params (`checkpointing.load_params`), what
        `load_params()` without arguments loads (JetStream's server calls it so).
      prefill_samples: a prompt's prefill draws first tokens for at least this many
        samples, at most the slots (fewer asked: the rest are dropped), so that
        starting 1, 2, 4, ... of a group compiles one prompt program per bucket, not
        one for each count. A run's slices take the group size.

    Served by JetStream's orchestrator as it is: see rollout/jetstream_compat.py.
    """

    def __init__(self, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, mesh: Mesh, *,
                 rules: Rules = DECODE_RULES, sampling_params: SamplingParams | None = None,
                 greedy: bool = False, tokenizer_path: str | None = None,
                 stop_ids: Sequence[int] | None = None, versions: int = 1,
                 checkpoint: str | None = None, prefill_samples: int = 1) -> None:
        check_versions(model_cfg, versions)
        if prefill_samples < 1:
            raise ValueError(f"prefill_samples must be at least 1, got {prefill_samples}")
        self.prefill_samples = min(prefill_samples, rollout_cfg.slots_per_slice)
        jetstream_compat.register_types((ResultTokens, "ResultTokens"), (Engine, "Engine"))
        self.checkpoint = checkpoint
        self._frees = jetstream_compat.SlotFrees(rollout_cfg.slots_per_slice)
        self._default_keys = jetstream_compat.DefaultKeys()
        self.model_cfg, self.rollout_cfg, self._mesh = model_cfg, rollout_cfg, mesh
        self.tokenizer_path = tokenizer_path
        self.stop_ids = sampling.stop_ids(rollout_cfg, tokenizer_path, stop_ids)
        bad = [i for i in self.stop_ids if not 0 <= i < model_cfg.vocab_size]
        if bad:
            raise ValueError(f"stop ids {bad} are outside the vocabulary "
                             f"[0, {model_cfg.vocab_size})")
        self.rules = tuple(rules)
        sp = sampling_params or SamplingParams.from_rollout(rollout_cfg)
        self.sampling_params = SamplingParams(sp.temperature, sp.top_k, sp.top_p,
                                              greedy or sp.greedy)
        self.buckets = prefill_buckets(rollout_cfg)  # padded prefill lengths
        # Slices decode from per-layer params (model/layer_layout.py), laid out when a
        # version is placed; the model's own layout is what load_params takes.
        self._placement = ParamPlacement(model_cfg, mesh, self.rules)
        self.graphdef = self._placement.graphdef
        self.versions = versions
        self.places = (AdapterPlaces(self._placement, versions) if versions > 1 else None)
        # Paged KV: the host-side page tables of this engine's decode state.
        self.pages = (PagePool(rollout_cfg.pool_pages, rollout_cfg.page_size,
                               rollout_cfg.slots_per_slice, rollout_cfg.cache_length,
                               paged_attention.in_place_views(
                                   rollout_cfg.paged_attention, rollout_cfg.kv_pages == 0))
                      if rollout_cfg.kv_cache == "paged" else None)
        param_sh = (self._placement if self.places is None else self.places).shardings
        fn, self._jit = shared_programs(
            layer_layout.decode_config(model_cfg), rollout_cfg, mesh, self.rules,
            self.sampling_params, self.graphdef, self._placement.treedef, tuple(self.stop_ids),
            None if self.pages is None else self.pages.num_pages, param_sh)
        self.generate_fn = fn.step

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
        """One: each sample of a prompt decodes in a slot of its own."""
        return 1

    @property
    def colocated_cpus(self) -> None:
        """Host CPUs colocated with the slice's devices; none are assigned."""
        return None

    @property
    def use_chunked_prefill(self) -> bool:
        """False: a prompt fits one prefill (prefill extends a Prefix, though)."""
        return False

    @property
    def prefill_chunk_size(self) -> int:
        return self.max_prefill_length

    def get_tokenizer(self) -> TokenizerParameters:
        """Where this engine's tokenizer lives, and the stop ids it decodes with."""
        if self.tokenizer_path is None:
            raise ValueError("this engine was built without a tokenizer_path")
        from dora_jax.text.tokenizer import TokenizerParameters
        jetstream_compat.register_types((ResultTokens, "ResultTokens"), (Engine, "Engine"))
        return TokenizerParameters(self.tokenizer_path, stop_ids=self.stop_ids)

    def build_tokenizer(self, metadata: TokenizerParameters) -> ServingTokenizer:
        """The tokenizer that `metadata` (from `get_tokenizer`) describes, with
        JetStream's tokenizer protocol (`.tokenizer`: our Tokenizer itself)."""
        from dora_jax.text.serving_tokenizer import ServingTokenizer
        from dora_jax.text.tokenizer import Tokenizer
        jetstream_compat.register_types((ResultTokens, "ResultTokens"), (Engine, "Engine"))
        return ServingTokenizer(Tokenizer.from_parameters(metadata), metadata.stop_ids,
                                self.pad_tokens, self.max_prefill_length)

    def load_params(self, params: nnx.State | dict[str, Any] | EngineParams | None = None
                    ) -> EngineParams:
        """Places `params` on this engine's mesh with the decode rules: the model's
        param nnx.State or its pure dict, on any devices (e.g. the trainer mesh), or
        EngineParams (returned as they are if already placed for this engine).
        Without `params`: those saved in the engine's `checkpoint` directory."""
        if params is None:
            if self.checkpoint is None:
                raise ValueError("load_params() without params loads the engine's "
                                 "checkpoint: build the Engine with checkpoint=<dir>")
            params = jetstream_compat.restore_params(self.checkpoint, self.model_cfg,
                                                     self._placement)
        return self._placement.place(params)

    @property
    def placement(self) -> ParamPlacement:
        """The model's leaves and their decode shardings on this engine's mesh."""
        return self._placement

    def init_decode_state(self) -> DecodeState:
        """Empty decode state: S inactive slots, zero KV cache (paged: every page
        free — the engine's page tables describe one decode state at a time)."""
        with self._frees.lock:
            self._frees.reset()
            if self.pages is not None:
                self.pages.reset()
        return self._jit.init()

    def free_resource(self, slot: int) -> None:
        """Releases the slot's KV pages (paged cache; nothing to do for the dense
        one). The slot stops decoding at the next generate call. Safe from another
        thread; a free that a later insert into the slot overtook releases nothing
        (jetstream_compat.SlotFrees)."""
        with self._frees.lock:
            if self._frees.release_now(slot) and self.pages is not None:
                self.pages.release(slot)

    def get_prefix_destination_sharding(self) -> Prefix:
        return self._jit.prefix_sharding

    def prefill(self, *, params: EngineParams, existing_prefix: Prefix | None = None,
                padded_tokens: np.ndarray, true_length: int, sampler: object = None,
                request_id: object = None, rng: Seed | None = None, num_generated: int = 0,
                max_new_tokens: int | None = None) -> tuple[Prefix, ResultTokens]:
        """Runs tokens through the model and samples the next one. Returns (Prefix,
        ResultTokens with one row).

        Without `existing_prefix`: the prompt (or prompt + response tokens so far,
        re-prefill) from position 0. With it (a Prefix this engine computed, e.g. the
        prompt of the request's group), the tokens are appended to the text it
        represents: they attend to its KV and only they run (chunked prefill; the
        caller makes sure the whole fits `cache_length`). With no new tokens
        (`true_length=0`: another sample of the same prompt) nothing runs and the
        token is drawn from the prefix's logits with this request's rng.

        padded_tokens: int[T] with T one of `self.buckets` (see `pad_tokens`); the
          first `true_length` are real.
        sampler: must be None (the engine's SamplingParams sample); request_id: unused.
        Extensions:
        rng: the request's RNG seed (int) or uint32[2] key data; omitted: a key of
          the engine's default scheme (jetstream_compat.DefaultKeys).
        num_generated: response tokens before the one to sample (among the tokens
          given, or the prefix's); the sampled token is response token `num_generated`.
        max_new_tokens: the request's response-length limit (at most, and by
          default, `max_decode_len`).
        """
        return self.prefill_multisampling(
            params=params, existing_prefix=existing_prefix, padded_tokens=padded_tokens,
            true_length=true_length, sampler=sampler, rng=[rng], num_samples=1,
            num_generated=num_generated, max_new_tokens=max_new_tokens)

    def prefill_multisampling(self, *, params: EngineParams,
                              existing_prefix: Prefix | None = None, padded_tokens: np.ndarray,
                              true_length: int, sampler: object = None,
                              rng: Sequence[Seed | None] | None = None, num_samples: int = 1,
                              num_generated: int = 0, max_new_tokens: int | None = None
                              ) -> tuple[Prefix, ResultTokens]:
        """`prefill` drawing `num_samples` first tokens from one forward pass: a Prefix
        of the shared KV cache and one token per sample (for `bulk_insert`), and
        ResultTokens with one row per sample. `rng`: one per sample, each as
        prefill's, so that sample i decodes as the prompt prefilled alone with rng[i]
        does. Other arguments (and the extensions) as in `prefill`."""
        sampling.refuse_sampler(sampler)
        rngs: list[sampling.Seed | None] = [None] * num_samples if rng is None else list(rng)
        if num_samples < 1 or len(rngs) != num_samples:
            raise ValueError(f"prefill: need one rng per sample ({num_samples}), got "
                             f"{len(rngs)}")
        if any(r is None for r in rngs) and not self.sampling_params.greedy:
            default = iter(self._default_keys.take(sum(r is None for r in rngs)))
            rngs = [next(default) if r is None else r for r in rngs]
        keys_N2 = np.stack([sampling.key_data_from_seed(0 if r is None else r) for r in rngs])
        tokens_T, limit = prefill_args.checked(self, padded_tokens, true_length, num_generated,
                                                max_new_tokens, existing_prefix is not None)
        done = np.int32(num_generated)
        if existing_prefix is None:
            width = max(num_samples, self.prefill_samples)
            rows = list(range(num_samples)) + [0] * (width - num_samples)
            out = self._jit.prefill(params, tokens_T, np.int32(true_length), keys_N2[rows],
                                    done, limit)
            if width > num_samples:
                out = first_samples(self._jit, out, num_samples)
        elif true_length == 0:
            out = self._jit.resample(existing_prefix.cache, existing_prefix.logits,
                                     existing_prefix.position, keys_N2, done, limit)
        else:
            out = self._jit.extend(params, existing_prefix, tokens_T, np.int32(true_length),
                                   keys_N2, done, limit,
                                   prefill_args.extended_length(self, existing_prefix, tokens_T))
        # One slot's samples, as JetStream's get_result_at_slot(0) reads a first token.
        return out[0], out[1].replace(samples_per_slot=num_samples)

    def prefill_continuations(self, *, params: EngineParams, prefixes: list,
                              padded_tokens: list, true_lengths: list, rngs: list,
                              num_generated: list, max_new_tokens: list) -> list:
        """Extension: `prefill(existing_prefix=prefixes[i], padded_tokens=...[i], ...)`
        for several requests in one batched call, each as alone (the observations of
        episodes that arrived together). The prefixes share a cache length and the
        tokens a bucket; at least one token each. Returns [(Prefix, ResultTokens)]."""
        n = len(prefixes)
        if not n or any(len(x) != n for x in (padded_tokens, true_lengths, rngs,
                                               num_generated, max_new_tokens)):
            raise ValueError("prefill_continuations: one of each argument per request")
        rows = [prefill_args.checked(self, t, c, g, m, True) for t, c, g, m in zip(
            padded_tokens, true_lengths, num_generated, max_new_tokens)]
        if (len({p.cache.length for p in prefixes}) != 1 or len({r[0].shape for r in rows}) != 1
                or min(true_lengths) < 1):
            raise ValueError("prefill_continuations: prefixes of one cache length, tokens of "
                             "one bucket, at least one token each")
        if any(r is None for r in rngs) and not self.sampling_params.greedy:
            raise ValueError("prefill: a per-request rng is required when sampling")
        # Compiled per power of two of rows: the padding rows repeat the first.
        idx = list(range(n)) + [0] * ((1 << (n - 1).bit_length()) - n)
        keys = [sampling.key_data_from_seed(0 if r is None else r)[None] for r in rngs]
        prefixes_out, results = self._jit.extend_many(
            params, tuple(prefixes[i] for i in idx), np.stack([rows[i][0] for i in idx]),
            np.asarray([true_lengths[i] for i in idx], np.int32), np.stack([keys[i] for i in idx]),
            np.asarray([num_generated[i] for i in idx], np.int32),
            np.asarray([rows[i][1] for i in idx], np.int32),
            prefill_args.extended_length(self, prefixes[0], rows[0][0]))
        return list(zip(prefixes_out[:n], results[:n]))

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int,
               request_id: object = None, *, length: int | None = None,
               shared_pages: Sequence[int] = ()) -> DecodeState:
        """Places a one-sample prefix in `slot` (donates `decode_state`). The prefix
        must be on this engine's mesh (`jax.device_put(prefix,
        get_prefix_destination_sharding())`). request_id: unused.

        Extensions, paged cache: the slot's previous pages are released and it gets
        pages for `length` positions (the prefix's written positions; default its
        whole length), the first of them `shared_pages` (`pages.share`: another
        slot's prompt pages, mapped, not copied). Raises PagesExhausted if the pool
        is short.
        """
        if prefix.num_samples != 1:
            raise ValueError(f"insert: the prefix holds {prefix.num_samples} samples; "
                             f"bulk_insert places them")
        return self._insert_rows(prefix, decode_state, [slot], length, shared_pages)

    def bulk_insert(self, prefix: Prefix, decode_state: DecodeState, slots: list[int], *,
                    length: int | None = None) -> DecodeState:
        """Places sample i of `prefix` (from `prefill_multisampling`) in `slots[i]`, in
        one call: what inserting each alone gives. Extension, paged cache: with `length`
        (the positions written) the slots map the prompt's whole pages of the first slot
        rather than copies."""
        if len(slots) != prefix.num_samples:
            raise ValueError(f"bulk_insert: {len(slots)} slots for {prefix.num_samples} "
                             f"samples")
        return self._insert_rows(prefix, decode_state, list(slots), length, (),
                                 share_first=length is not None)

    def _insert_rows(self, prefix: Prefix, decode_state: DecodeState, slots: list[int],
                     length: int | None, shared_pages: Sequence[int],
                     share_first: bool = False) -> DecodeState:
        """Sample i of `prefix` into slots[i] (row 0 of a one-sample prefix into
        slots[0]); paged: each slot maps `shared_pages`, or with `share_first` the
        first slot's whole prompt pages, and fresh pages for the rest."""
        for slot in slots:
            if not 0 <= slot < self.max_concurrent_decodes:
                raise ValueError(f"insert: slot {slot} out of range [0, "
                                 f"{self.max_concurrent_decodes})")
        if prefix.cache.length > self.cache_length:
            raise ValueError(f"insert: prefix of length {prefix.cache.length} exceeds "
                             f"cache_length {self.cache_length}")
        write_Nn = None
        written = prefix.cache.length if length is None else length
        if self.pages is not None and not 0 < written <= prefix.cache.length:
            raise ValueError(f"insert: length {written} outside the prefix's "
                             f"(1..{prefix.cache.length})")
        with self._frees.lock:
            if self.pages is not None:
                write_Nn = self.pages.assign_rows(slots, written, prefix.cache.length,
                                                  shared_pages, share_first)
            for slot in slots:
                self._frees.inserted(slot)
        # Compiled per power of two of rows: the padding rows repeat the first.
        idx = list(range(len(slots))) + [0] * ((1 << (len(slots) - 1).bit_length()) - len(slots))
        return self._jit.insert(prefix, decode_state, np.asarray(slots, np.int32)[idx],
                                np.arange(len(slots), dtype=np.int32)[idx],
                                None if write_Nn is None else write_Nn[idx])

    def generate(self, params: EngineParams, decode_state: DecodeState, sampler: object = None
                 ) -> tuple[DecodeState, ResultTokens]:
        """One decode step of every slot (donates `decode_state`). Returns (new
        DecodeState, ResultTokens [S, 6]; rows of inactive slots are not valid).
        Paged cache: first maps the pages the step writes (PagesExhausted if the
        pool is short). sampler: must be None."""
        sampling.refuse_sampler(sampler)
        return self._jit.step(params, decode_state, self._page_view(1))

    def compiled_step(self, params: EngineParams) -> jax.stages.Compiled:
        """The one-token decode step (`generate`) of `params`, compiled for the page
        view as it stands (nothing changes; `rollout/step_cost.py` counts it). `params`
        may be abstract (ShapeDtypeStructs with the placement's shardings)."""
        step = cast("jax.stages.Wrapped", self._jit.step)  # a jax.jit (programs.py)
        view = None if self.pages is None else self.pages.view()
        return step.lower(params, jax.eval_shape(self._jit.init), view).compile()

    # ----------------------------------------------------------- extensions

    @property
    def max_decode_len(self) -> int:
        return self.rollout_cfg.max_decode_len

    @property
    def decode_steps(self) -> int:
        """Most tokens per slot per `generate_steps` call."""
        return self.rollout_cfg.decode_steps

    @property
    def cache_length(self) -> int:
        return self.rollout_cfg.cache_length

    def generate_steps(self, params: EngineParams, decode_state: DecodeState,
                       max_steps: int | None = None) -> tuple[DecodeState, ResultTokens]:
        """Extension: up to `decode_steps` (or `max_steps`, if fewer) decode steps of
        every slot in one dispatch, ending after the first step in which a slot
        finishes (donates `decode_state`). Returns (new DecodeState, ResultTokens
        [decode_steps, S, 6]; rows of steps not run are not valid). Paged cache: as
        `generate`, for every position the call may write (see `pages.shortfall`)."""
        n = self.decode_steps if max_steps is None else min(max_steps, self.decode_steps)
        return self._jit.steps(params, decode_state, np.int32(n), self._page_view(n))

    def _page_view(self, n: int) -> PageView | None:
        if self.pages is None:
            return None
        with self._frees.lock:
            self.pages.advance(n)  # pages for every position the call may write
            return self.pages.view()

    def extract(self, decode_state: DecodeState, slot: int, used: int | None = None) -> Prefix:
        """A slot's decode state as a one-sample Prefix (next input token, position,
        RNG key, step, and its KV cache): what migration moves. With `used`
        (positions written so far, prompt + response), only the smallest bucket
        holding them is moved rather than the whole cache_length."""
        if not 0 <= slot < self.max_concurrent_decodes:
            raise ValueError(f"extract: slot {slot} out of range")
        length = self.cache_length if used is None else pick_bucket(
            used, self.buckets + (self.cache_length,), "extract buckets")
        pages = None
        if self.pages is not None:
            with self._frees.lock:
                pages = self.pages.table[slot, :self.pages.pages_for(length)].copy()
        return self._jit.extract(decode_state, np.int32(slot), pages, length)

    def pad_tokens(self, tokens: Sequence[int] | np.ndarray) -> tuple[np.ndarray, int]:
        """(tokens padded with pad_id to their bucket, true length)."""
        tokens = np.asarray(tokens, np.int32)
        padded = np.full(pick_bucket(len(tokens), self.buckets, "prefill buckets"),
                         self.rollout_cfg.pad_id, np.int32)
        padded[:len(tokens)] = tokens
        return padded, len(tokens)

