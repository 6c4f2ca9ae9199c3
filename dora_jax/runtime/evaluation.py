"""Evaluation during training: held-out prompts, greedy pass@1 and sampled pass@k.

Every `eval.every` train steps (and before the first step and after the last) the
coordinator sends one decode slice (`eval.slice`) an `eval` command carrying the
version just published and its params. The slice's loop runs it between two of its
generate calls (worker.py): its own requests wait meanwhile, the other slices go on.
The responses come from an `EvalDecoder`, two decode slices of their own on the host
slice's mesh (greedy, and sampled with the rollout's settings), so the host slice's
decode state, KV cache and continuous batching are untouched, and the eval's
requests never reach the scheduler, the group book or the ledger: held-out prompts
are removed from the prompt set before training draws from it (tasks/sources.py
`held_out_split`), and eval samples are not groups. Their rewards come from the
reward pool's workers, as training rewards do.

Each evaluation becomes one metrics record, written with the step records (to
metrics.jsonl, TensorBoard and W&B) once its rewards are in:
`{"step": version, "eval": {"version", "pass_at_1", "pass_at_k", "k", ...}}` (names
TensorBoard keeps as they are), where `step` is the policy version evaluated (the
params after that many train steps), so a resumed run that trains a step again also
drops and redoes its evaluation. pass_at_1 is the greedy response's; pass_at_k the
unbiased estimate from `eval.samples` sampled responses; a response is correct when
its reward is at least `eval.pass_reward`.

An evaluation whose slice fails before reporting it is dropped (the slice restarts
as after any failure). Costs: the decoder's programs compile before the run's clock
starts; each evaluation places the version's params on the host slice (unless it
holds that version already) and holds them, with the decoder's two KV caches, while
it runs.
"""

from __future__ import annotations

import concurrent.futures
import math
import queue
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from dora_jax.config.report import EvalConfig
from dora_jax.rewards import pool as pool_lib
from dora_jax.rollout.slice import DecodeSlice
from dora_jax.rollout.trajectory import Request
from dora_jax.runtime.events import EvalGenerated, EvalScored

if TYPE_CHECKING:
    from flax import nnx

    from dora_jax.rollout.trajectory import InFlight


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of the chance that at least one of k samples is correct,
    from n samples of which c are correct (Chen et al., 2021): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarise(cfg: EvalConfig, greedy: list[tuple[float, int]],
              sampled: list[list[tuple[float, int]]]) -> dict:
    """The figures of one evaluation from (reward, response length) pairs: one
    greedy response per prompt, `cfg.samples` sampled ones per prompt."""
    def correct(r: float) -> bool:
        return r >= cfg.pass_reward

    n_correct = [sum(correct(r) for r, _ in s) for s in sampled]
    lengths = [n for _, n in greedy]
    sampled_lengths = [n for s in sampled for _, n in s]
    return {
        "prompts": len(greedy),
        "pass_at_1": round(float(np.mean([correct(r) for r, _ in greedy])), 6),
        "pass_at_k": round(float(np.mean([pass_at_k(len(s), c, cfg.k)
                                       for s, c in zip(sampled, n_correct)])), 6),
        "k": cfg.k,
        "samples": cfg.samples,
        "sampled_pass_at_1": round(float(np.mean([c / len(s) for s, c in
                                               zip(sampled, n_correct)])), 6),
        "reward_mean": round(float(np.mean([r for r, _ in greedy])), 6),
        "response_length": round(float(np.mean(lengths)), 3),
        "sampled_response_length": round(float(np.mean(sampled_lengths)), 3),
    }


def _seed(run_seed: int, version: int, prompt: int, sample: int) -> np.ndarray:
    # A function of the version and the request only: an evaluation is reproducible.
    return np.random.SeedSequence([run_seed, 0xE7A1, version, prompt, sample]).generate_state(2)


class EvalDecoder:
    """A greedy and a sampled decode slice on a host slice's mesh, sharing its
    engine's settings (rules, stop ids, tokenizer), for evaluation only.

    Runs on the host slice's worker thread (worker.py); not thread-safe."""

    def __init__(self, host: DecodeSlice, cfg: EvalConfig, run_seed: int,
                 **engine_kwargs: Any) -> None:
        e = host.engine
        kwargs = dict(rules=e.rules, stop_ids=e.stop_ids, tokenizer_path=e.tokenizer_path,
                      **engine_kwargs)
        self.cfg, self.run_seed, self.slice_id = cfg, run_seed, host.slice_id
        self.greedy = DecodeSlice.create(host.slice_id, e.mesh, e.model_cfg, e.rollout_cfg,
                                         lookahead=False, greedy=True, **kwargs)
        self.sampled = DecodeSlice.create(host.slice_id, e.mesh, e.model_cfg, e.rollout_cfg,
                                          lookahead=False, **kwargs)

    def warm(self, params: nnx.State) -> None:
        """Compiles both slices' programs on `params` (placed on the host's mesh)."""
        from dora_jax.rollout.warmup import warm_engine

        for sl in (self.greedy, self.sampled):
            warm_engine(sl.engine, params, reprefills=False)
            sl.reset_decode_state()

    def generate(self, version: int, params: nnx.State,
                 records: list[dict]) -> tuple[list[InFlight], list[list[InFlight]]]:
        """(greedy trajectories, one per record; sampled ones, `cfg.samples` per
        record, as lists) of `version` with `params`; the params are dropped after."""
        try:
            greedy = self._run(self.greedy, version, params, records, 1)
            sampled = self._run(self.sampled, version, self.greedy.params, records,
                                self.cfg.samples)
        finally:  # also after a failure, so that the next evaluation starts empty
            for sl in (self.greedy, self.sampled):
                sl.abandon()  # frees the params and the pages they used
        return [g[0] for g in greedy], sampled

    def _run(self, sl: DecodeSlice, version: int, params: nnx.State, records: list[dict],
             n: int) -> list[list]:
        sl.load_version(version, params)
        todo = [Request(group_id=i, prompt_id=r["prompt_id"], sample_index=j,
                        prompt_tokens=r["tokens"], version=version,
                        seed=_seed(self.run_seed, version, i, j))
                for i, r in enumerate(records) for j in range(n)]
        todo.reverse()
        out: list[list] = [[None] * n for _ in records]
        while todo or sl.num_requests:
            while todo and sl.num_free_slots:
                sl.submit(todo.pop())
            for t in sl.step():
                out[t.group_id][t.sample_index] = t
        return out


class EvalHost(Protocol):
    """The slice an evaluation is sent to (worker.py's `SliceWorker`, which imports
    this module): it runs `decoder` between two of its generate calls."""

    def evaluate(self, decoder: EvalDecoder, version: int,
                 params: nnx.State | concurrent.futures.Future, records: list) -> None: ...


class Evaluation:
    """The coordinator's side of evaluation: when one is due, sending it to the
    slice, scoring its responses, and its metrics record. Called on the
    coordinator's thread only."""

    def __init__(self, cfg: EvalConfig, records: Sequence[dict], decoder: EvalDecoder,
                 rewards: pool_lib.RewardPool, events: queue.Queue,
                 clock: Callable[[], float]) -> None:
        self.cfg, self.records, self.decoder = cfg, list(records), decoder
        self._rewards, self._events, self._clock = rewards, events, clock
        self._pending: dict[int, EvalGenerated | None] = {}  # version -> generated
        self._scores: dict[int, tuple] = {}
        self.evaluated: set[int] = set()
        self.dropped: set[int] = set()  # sent, then lost with their slice

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def due(self, version: int) -> bool:
        """Version `version` is one to evaluate (every `eval.every` steps)."""
        return version % self.cfg.every == 0 and version not in self.evaluated

    def start(self, worker: EvalHost, version: int,
              params: nnx.State | concurrent.futures.Future) -> None:
        """Sends the evaluation of `version` (its `params`) to `worker`."""
        self.evaluated.add(version)
        self._pending[version] = None
        worker.evaluate(self.decoder, version, params, self.records)

    def offer(self, worker: EvalHost, version: int,
              params: nnx.State | concurrent.futures.Future, *, last: bool = False) -> None:
        """Starts `version`'s evaluation if one is due, or if `last` (the run's final
        version) and none ran."""
        if self.due(version) or (last and version not in self.evaluated):
            self.start(worker, version, params)

    def finish(self, offer_last: Callable[[], int], take_event: Callable[[], object]) -> None:
        """Evaluates the final version if none has (`offer_last` returns it), taking
        events until every evaluation sent is scored; once more if its slice failed
        before running it."""
        for _ in range(2):
            version = offer_last()
            while self.pending:
                take_event()
            if not self.take_back(version):
                break

    def lost(self, slice_id: int) -> None:
        """The slice failed: the evaluations it had not yet reported are dropped."""
        if slice_id == self.decoder.slice_id:
            for v in [v for v, g in self._pending.items() if g is None]:
                del self._pending[v]
                self.dropped.add(v)

    def take_back(self, version: int) -> bool:
        """Whether `version`'s evaluation was lost with its slice before it ran; if
        so it may be sent again (to the restarted slice)."""
        if version not in self.dropped:
            return False
        self.dropped.discard(version)
        self.evaluated.discard(version)
        return True

    def generated(self, ev: EvalGenerated) -> None:
        """Sends every response to the reward pool; `EvalScored` follows."""
        self._pending[ev.version] = ev
        greedy = [self._rewards.submit(r, t.response_tokens)
                  for r, t in zip(self.records, ev.greedy)]
        sampled = [[self._rewards.submit(r, t.response_tokens) for t in ts]
                   for r, ts in zip(self.records, ev.sampled)]
        self._scores[ev.version] = (greedy, sampled)
        pool_lib.when_all_done(greedy + [f for fs in sampled for f in fs],
                               lambda: self._events.put(EvalScored(ev.version)))

    def scored(self, ev: EvalScored) -> dict:
        """The evaluation's metrics record."""
        gen = self._pending.pop(ev.version)
        assert gen is not None  # its EvalGenerated came first
        greedy, sampled = self._scores.pop(ev.version)

        def pairs(fs: Sequence[concurrent.futures.Future], ts: Sequence[InFlight]
                  ) -> list[tuple[float, int]]:
            return [(f.result()[0], len(t.response_tokens)) for f, t in zip(fs, ts)]

        figures = summarise(self.cfg, pairs(greedy, gen.greedy),
                            [pairs(fs, ts) for fs, ts in zip(sampled, gen.sampled)])
        errors = sum(f.result()[1] is not None
                     for f in greedy + [f for fs in sampled for f in fs])
        return {"step": ev.version,
                "eval": {"version": ev.version, **figures, "reward_errors": errors,
                         "slice": gen.slice_id, "seconds": round(gen.end - gen.start, 4),
                         "time": round(self._clock(), 4)}}
