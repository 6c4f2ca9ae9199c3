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

Limits: `max_turns` model turns (default: the environment's own), the request's
token budget (prompt aside, model and observation tokens together:
`rollout.max_decode_len`), and `timeout` seconds per environment call (past it the
episode ends with reward 0; the call's thread is left to finish, which is why tools
bound their own time: sandbox.py kills its process).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import inspect
import threading
import time

from dora_jax.envs import base
from dora_jax.rewards.pool import one_line
from dora_jax.turns import model_token_mask  # noqa: F401 - the rule, re-exported

# Why an episode ended: the environment said so, it raised, it took too long, the
# turn limit, or the token budget (its last turn was cut).
END_REASONS = ("done", "env_error", "env_timeout", "max_turns", "budget")


@dataclasses.dataclass
class Episode:
    """One episode's host-side record, travelling with its request (migration
    included)."""

    env: base.Environment
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


def observation_tokens(tokenizer, frame: tuple, text: str) -> list:
    """Token ids of an observation's text between the ids of `frame`
    (`observation_frame`), the tokenizer's special-token markers in it broken up."""
    markers = sorted(getattr(tokenizer, "special_tokens", ()) or (), key=len, reverse=True)
    return frame[0] + tokenizer.encode(_break_markers(text, markers)) + frame[1]


def _break_markers(text: str, markers) -> str:
    # A zero-width space inside each marker keeps the text readable and unable to
    # encode as the special token.
    for m in markers:
        if len(m) > 1 and m in text:
            text = text.replace(m, m[0] + "\u200b" + m[1:])
    return text


class EpisodeRunner:
    """Starts episodes, calls their environments off the slice's thread and turns
    observations into tokens.

    Args:
      env: the environment's registered name (`envs.base.get`).
      tokenizer: decodes turns and encodes observations (text/tokenizer.py).
      max_turns: model turns per episode; 0: the environment's own `max_turns`.
      timeout: seconds an environment call may take.
      workers: environment calls at once (per slice).
      frame: (ids before, ids after) an observation's text; None: the tokenizer's
        chat template's framing of a tool message (`observation_frame`).
    """

    def __init__(self, env: str, tokenizer, *, max_turns: int = 0, timeout: float = 30.0,
                 workers: int = 4, frame: tuple | None = None,
                 isolation: str = "namespaces"):
        self.env_cls = base.get(env)
        self.isolation = isolation
        self.tokenizer = tokenizer
        self.max_turns = max_turns or self.env_cls.max_turns
        self.timeout = timeout
        self._name = f"env {env}"
        self._running = threading.BoundedSemaphore(workers)  # calls at once
        self.frame = observation_frame(tokenizer) if frame is None else frame

    def begin(self, record: dict) -> Episode:
        """A new episode on `record` (its environment reset)."""
        env = self.env_cls()
        if env.sandbox_isolation is not None:
            env.sandbox_isolation = self.isolation
        env.reset(record)
        return Episode(env)

    def step(self, episode: Episode, turn_tokens: list) -> concurrent.futures.Future:
        """Sends a model turn to the episode's environment; the future gives
        (StepResult, seconds, error or None) and never raises."""
        future, turn = concurrent.futures.Future(), list(turn_tokens)

        def call():
            with self._running:
                if future.set_running_or_notify_cancel():
                    future.set_result(self._call(episode.env, turn))

        # A daemon thread per call: a call that never returns (past `timeout` its
        # episode has ended) cannot hold the process at exit, as a pool's would.
        threading.Thread(target=call, name=self._name, daemon=True).start()
        return future

    def _call(self, env: base.Environment, turn_tokens: list):
        start = time.perf_counter()
        try:
            result = env.step(self.tokenizer.decode(turn_tokens, skip_special_tokens=True))
            if inspect.isawaitable(result):
                result = asyncio.run(_awaited(result))
            if not isinstance(result, base.StepResult):
                raise TypeError(f"step returned {type(result).__name__}, not a StepResult")
            return result, time.perf_counter() - start, None
        except Exception as e:  # noqa: BLE001 - the episode ends with the reason
            return base.StepResult("", 0.0, True), time.perf_counter() - start, one_line(e)

    def observation_tokens(self, text: str) -> list:
        """Token ids of an observation, framed as a tool message, after which the
        model's next turn begins."""
        return observation_tokens(self.tokenizer, self.frame, text)

    def close(self) -> None:
        """Nothing to release: calls run on daemon threads."""


async def _awaited(awaitable):
    return await awaitable


def observation_frame(tokenizer) -> tuple[list, list]:
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


def demonstration_tokens(env_cls, record: dict, tokenizer, frame: tuple) -> dict:
    """An environment's demonstration of `record` as a response: each model turn's
    text and the turn's end token, each observation framed by `frame` as the runner
    frames it; {"response_tokens", "episode"} with the turns."""
    tokens, turns = [], []
    for role, text in env_cls.demonstration(record):
        if role == "model":
            ids = tokenizer.encode(text) + [tokenizer.stop_ids[0]]
        else:
            ids = observation_tokens(tokenizer, frame, text)
        turns.append([role, len(tokens), len(tokens) + len(ids)]
                     + ([0.0] if role == "env" else []))
        tokens += ids
    return {"response_tokens": tokens, "episode": {"turns": turns}}
