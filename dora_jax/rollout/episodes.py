"""Multi-turn episodes on a decode slice: the host side of each episode and the
environment calls, off the slice's thread.

A decode slice (slice.py) runs an episode as one request whose response alternates
model turns and observations. A model turn ends where a single-turn sample would
(a stop id); the slice keeps the KV of everything so far, frees the slot and hands
the turn's text to `EpisodeRunner.step`, which calls the environment on a thread
pool and returns a future. Meanwhile the slice decodes its other requests. When the
observation is in, its tokens join the response (no loss, no log-prob: the batch
masks them by the episode's `turns`) and are prefilled on top of the kept KV, and
the next model turn decodes under the same version (C1 for the whole episode).

Observations are framed as the tokenizer's chat template frames a `tool` message
after an assistant turn, so the model sees what a chat would show it; the text
inside is the environment's and may echo the model's own text, so special-token
markers in it are broken up before encoding (an observation cannot close its own
message or open an assistant turn).

Calls run on one event loop per runner: a coroutine `step` runs there, a plain one on
a daemon thread of its own, at most `workers` calls at once (later ones queue: back-
pressure, not failure). `latency` adds a deterministic delay to every call (slow-tool
benchmarks), awaited on the loop, so a slow call holds no thread.

Limits: `max_turns` model turns (default: the environment's own), the request's
token budget (prompt aside, model and observation tokens together:
`rollout.max_decode_len`), and `timeout` seconds per environment call from its start
(past it the episode ends with reward 0 and a coroutine is cancelled; a thread is left
to finish, which is why tools bound their own time: sandbox.py kills its process).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import inspect
import math
import threading
import time
from collections.abc import Awaitable, Iterable
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from dora_jax import envs
from dora_jax.base.turns import model_token_mask  # noqa: F401 - the rule, re-exported
from dora_jax.rewards.pool import one_line

if TYPE_CHECKING:
    from dora_jax.text.tokenizer import Tokenizer

_R = TypeVar("_R")

# Why an episode ended: the environment said so, it raised, it took too long, the
# turn limit, or the token budget (its last turn was cut).
END_REASONS = ("done", "env_error", "env_timeout", "max_turns", "budget")


@dataclasses.dataclass
class Episode:
    """One episode's host-side record, travelling with its request (migration
    included)."""

    env: envs.Environment
    seed: int = 0  # the request's: draws the latency of each call
    # [["model", start, end] | ["env", start, end, seconds of the call], ...]
    turns: list = dataclasses.field(default_factory=list)
    reward: float = 0.0
    info: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    env_seconds: float = 0.0
    end: str | None = None
    error: str | None = None

    @property
    def model_turns(self) -> int:
        return sum(1 for role, *_ in self.turns if role == "model")

    @property
    def next_start(self) -> int:
        """The response index where the next turn begins."""
        return self.turns[-1][2] if self.turns else 0

    def summary(self) -> dict:
        """JSON form (Trajectory.episode; the ledger's per-sample turns)."""
        return {"turns": [list(t) for t in self.turns], "reward": float(self.reward),
                "info": dict(self.info), "env_s": round(self.env_seconds, 6),
                "end": self.end, "error": self.error,
                "sandbox": self.env.sandbox_isolation}


def observation_tokens(tokenizer: Tokenizer, frame: tuple[list[int], list[int]], text: str
                       ) -> list[int]:
    """Token ids of an observation's text between the ids of `frame`
    (`observation_frame`), the tokenizer's special-token markers in it broken up."""
    markers = sorted(getattr(tokenizer, "special_tokens", ()) or (), key=len, reverse=True)
    return frame[0] + tokenizer.encode(_break_markers(text, markers)) + frame[1]


def _break_markers(text: str, markers: Iterable[str]) -> str:
    # A zero-width space inside each marker keeps the text readable and unable to
    # encode as the special token.
    for m in markers:
        if len(m) > 1 and m in text:
            text = text.replace(m, m[0] + "\u200b" + m[1:])
    return text


@dataclasses.dataclass(frozen=True)
class Latency:
    """Seconds added to an environment call: log-normal around `median` with shape
    `sigma`, at most `most`, drawn from (episode seed, call index) so a rerun (or a
    resumed run) waits as long."""

    median: float
    sigma: float = 1.0
    most: float = float("inf")

    def draw(self, seed: int, call: int) -> float:
        z = np.random.default_rng([seed & 0xFFFFFFFF, call]).standard_normal()
        return float(min(self.most, self.median * math.exp(self.sigma * z)))


class EnvCall:
    """One environment call: its future ((StepResult, seconds, error or None), never
    raises) and when it started running (None while queued behind `workers` calls)."""

    def __init__(self) -> None:
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.started: float | None = None

    def timed_out(self, now: float, timeout: float) -> bool:
        return self.started is not None and now - self.started > timeout


class EpisodeRunner:
    """Starts episodes, calls their environments off the slice's thread and turns
    observations into tokens.

    Args:
      env: the environment's registered name (`envs.get`).
      tokenizer: decodes turns and encodes observations (text/tokenizer.py).
      max_turns: model turns per episode; 0: the environment's own `max_turns`.
      timeout: seconds an environment call may take once started.
      workers: environment calls at once (per slice).
      latency: a delay added to every call (None: none).
      frame: (ids before, ids after) an observation's text; None: the tokenizer's
        chat template's framing of a tool message (`observation_frame`).
    """

    def __init__(self, env: str, tokenizer: Tokenizer, *, max_turns: int = 0,
                 timeout: float = 30.0, workers: int = 4,
                 frame: tuple[list[int], list[int]] | None = None,
                 isolation: str = "namespaces", latency: Latency | None = None) -> None:
        self.env_cls = envs.get(env)
        self.isolation = isolation
        self.tokenizer = tokenizer
        self.max_turns = max_turns or self.env_cls.max_turns
        self.timeout = timeout
        self._name = f"env {env}"
        self.workers, self.latency = workers, latency
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None  # calls at once, on the loop
        self._lock = threading.Lock()
        self.frame = observation_frame(tokenizer) if frame is None else frame

    def begin(self, record: dict, seed: int = 0) -> Episode:
        """A new episode on `record` (its environment reset)."""
        env = self.env_cls()
        if env.sandbox_isolation is not None:
            env.sandbox_isolation = self.isolation
        env.reset(record)
        return Episode(env, seed=seed)

    def step(self, episode: Episode, turn_tokens: list) -> EnvCall:
        """Sends a model turn to the episode's environment."""
        call, text = EnvCall(), self.tokenizer.decode(list(turn_tokens),
                                                      skip_special_tokens=True)
        delay = 0.0 if self.latency is None else self.latency.draw(
            episode.seed, episode.model_turns)
        task = asyncio.run_coroutine_threadsafe(
            self._run(episode.env, text, delay, call), self._event_loop())
        # Cancelling the call (a timeout) cancels its task, which frees its place.
        call.future.add_done_callback(lambda f: f.cancelled() and task.cancel())
        return call

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=_serve, args=(loop,), name=self._name,
                                 daemon=True).start()
                self._loop = loop
            return self._loop

    async def _run(self, env: envs.Environment, text: str, delay: float, call: EnvCall
                   ) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        async with self._slots:
            if not call.future.set_running_or_notify_cancel():
                return
            start = call.started = time.perf_counter()
            result, _, error = await self._step(env, text)
            await asyncio.sleep(max(0.0, delay - (time.perf_counter() - start)))
            call.future.set_result((result, time.perf_counter() - start, error))

    @staticmethod
    async def _step(env: envs.Environment, text: str
                    ) -> tuple[envs.StepResult, float, str | None]:
        """(StepResult, seconds, error or None) of `env.step(text)`, never raising."""
        start = time.perf_counter()
        try:
            if inspect.iscoroutinefunction(env.step):
                result = await env.step(text)
            else:
                result = await _on_thread(env, text, f"env {type(env).__name__}")
            if not isinstance(result, envs.StepResult):
                raise TypeError(f"step returned {type(result).__name__}, not a StepResult")
            return result, time.perf_counter() - start, None
        except Exception as e:  # noqa: BLE001 - the episode ends with the reason
            return envs.StepResult("", 0.0, True), time.perf_counter() - start, one_line(e)


    def observation_tokens(self, text: str) -> list:
        """Token ids of an observation, framed as a tool message, after which the
        model's next turn begins."""
        return observation_tokens(self.tokenizer, self.frame, text)

    def close(self) -> None:
        """Stops the event loop (calls still running are dropped with it)."""
        with self._lock:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._loop = None


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    try:
        loop.run_forever()
    finally:
        # The calls still running are dropped: cancelled and let unwind (briefly),
        # not destroyed pending with the loop.
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=1.0))
        loop.close()


async def _awaited(awaitable: Awaitable[_R]) -> _R:
    return await awaitable


async def _on_thread(env: envs.Environment, text: str, name: str) -> envs.StepResult:
    """A plain `step` on a daemon thread of its own: one that never returns (past
    `timeout` its episode has ended) cannot hold the process at exit, as a pool's
    thread would."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def work() -> None:
        try:
            result, error = env.step(text), None
            if inspect.isawaitable(result):  # a coroutine from a plain function
                result = asyncio.run(_awaited(result))
        except Exception as e:  # noqa: BLE001 - handed to the loop, raised there
            result, error = None, e
        try:
            loop.call_soon_threadsafe(_settle, done, result, error)
        except RuntimeError:  # the loop was closed: its runner dropped the call
            pass

    threading.Thread(target=work, name=name, daemon=True).start()
    return await done


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.done():  # cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def observation_frame(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """(ids before, ids after) an observation's text: what the chat template puts
    between an assistant turn's end token and a tool message's text, and between
    that text and the next assistant turn's first token."""
    mark = "\u2063OBSERVATION\u2063"
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with_tool = tokenizer.decode(tokenizer.apply_chat_template(
        chat + [{"role": "tool", "content": mark}], add_generation_prompt=True),
        skip_special_tokens=False)
    upto_answer = tokenizer.decode(tokenizer.apply_chat_template(
        chat, add_generation_prompt=False), skip_special_tokens=False)
    eos = tokenizer.decode([tokenizer.stop_ids[0]], skip_special_tokens=False)
    # The assistant turn ends at its end token: the model's stop; what follows is ours.
    cut = upto_answer.rfind(eos)
    if cut < 0 or not with_tool.startswith(upto_answer[:cut + len(eos)]):
        raise ValueError("the tokenizer's chat template does not end an assistant turn "
                         "with its stop token; multi-turn episodes need it to")
    rest = with_tool[cut + len(eos):]
    before, _, after = rest.partition(mark)
    return tokenizer.encode(before), tokenizer.encode(after)


def demonstration_tokens(env_cls: type[envs.Environment], record: dict, tokenizer: Tokenizer,
                         frame: tuple[list[int], list[int]]) -> dict:
    """An environment's demonstration of `record` as a response: each model turn's
    text and the turn's end token, each observation framed by `frame` as the runner
    frames it; {"response_tokens", "episode"} with the turns."""
    tokens: list[int] = []
    turns: list[list] = []
    for role, text in env_cls.demonstration(record):
        if role == "model":
            ids = tokenizer.encode(text) + [tokenizer.stop_ids[0]]
        else:
            ids = observation_tokens(tokenizer, frame, text)
        turns.append([role, len(tokens), len(tokens) + len(ids)]
                     + ([0.0] if role == "env" else []))
        tokens += ids
    return {"response_tokens": tokens, "episode": {"turns": turns}}
