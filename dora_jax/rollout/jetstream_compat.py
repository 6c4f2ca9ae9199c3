"""What JetStream's own server loop (`jetstream.core.orchestrator`) needs of an Engine
beyond the method names: its types, sampling keys for prefills given no rng, prompts
padded to its buckets, and slot frees from another thread.

- Types. Its detokenize thread tells a first token from a generate step with
  `isinstance(x, engine_api.ResultTokens)`. Our ResultTokens has JetStream's fields
  and methods (and columns of its own); `register_types` makes it (and Engine) a
  virtual subclass of JetStream's abstract classes, so dora_jax does not depend on
  JetStream. It runs whenever an Engine is built or hands out its tokenizer (which
  every server thread does before its first request) with JetStream's engine_api
  loaded, and imports nothing itself.
- Keys. JetStream's server passes no rng to prefill. `DefaultKeys` numbers the
  samples an engine draws without one: sample n (0, 1, ... across calls, in call
  order) samples with key data [DEFAULT_STREAM, n mod 2**32], i.e. with the int seed
  `DEFAULT_STREAM << 32 | n`. Our runtime passes each request's own seed (below 2**63,
  so never one of these) and so stays reproducible.
- Buckets. JetStream pads prompts to its own buckets (16, 32, ... up to
  max_prefill_length); `rebucket` re-pads the real tokens to the engine's bucket on
  the host, so nothing compiles beyond the engine's buckets.
- Frees. Its detokenize thread puts a finished slot back on the free queue and only
  then calls `free_resource(slot)`; the generate thread may insert the next request
  into that slot in between. `SlotFrees` pairs each free with the insert it ends.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from flax import nnx

    from dora_jax.config import ModelConfig
    from dora_jax.rollout.placement import ParamPlacement

DEFAULT_STREAM = 0x80000000


def register_types(*pairs: tuple[type, str]) -> bool:
    """Registers each (our class, JetStream's class name in engine_api) pair as a
    virtual subclass, if JetStream's engine_api is loaded; True if it was."""
    api = sys.modules.get("jetstream.engine.engine_api")
    if api is None:
        return False
    for ours, name in pairs:
        base = getattr(api, name, None)
        if base is not None and not issubclass(ours, base):
            base.register(ours)
    return True


class DefaultKeys:
    """Key data for samples drawn without an rng (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0

    def take(self, n: int) -> list[np.ndarray]:
        with self._lock:
            first, self._next = self._next, self._next + n
        return [np.array([DEFAULT_STREAM, (first + i) & 0xFFFFFFFF], np.uint32)
                for i in range(n)]


def rebucket(tokens_T: np.ndarray, true_length: int, buckets: Sequence[int], pad_id: int,
             pick: Callable[[int, Sequence[int], str], int]) -> np.ndarray:
    """`tokens_T` if its length is one of `buckets`, else its first `true_length`
    tokens padded with `pad_id` to the smallest bucket that holds them (`pick`)."""
    if tokens_T.ndim != 1 or tokens_T.shape[0] in buckets or true_length > tokens_T.shape[0]:
        return tokens_T
    out = np.full(pick(max(true_length, 1), buckets, "prefill buckets"), pad_id, np.int32)
    out[:true_length] = tokens_T[:true_length]
    return out


class SlotFrees:
    """Pairs `free_resource(slot)` calls with inserts, and serialises page-table
    changes (`lock`) between the thread that inserts and generates and the one that
    frees.

    A slot's k-th free ends its k-th insert. Under JetStream's thread model at most one
    insert can overtake a free (the next free of the slot comes from the same thread,
    after the slot's next request finished), so a free that finds two unfreed inserts
    belongs to the earlier one, whose pages the later insert already released: it
    releases nothing.
    """

    def __init__(self, slots: int) -> None:
        self.lock = threading.RLock()
        self._unfreed = np.zeros(slots, np.int64)

    def reset(self) -> None:
        self._unfreed[:] = 0

    def inserted(self, slot: int) -> None:
        self._unfreed[slot] += 1

    def release_now(self, slot: int) -> bool:
        """Records a free of `slot`; True if its current occupant's pages go now."""
        if self._unfreed[slot] > 1:
            self._unfreed[slot] -= 1
            return False
        self._unfreed[slot] = 0
        return True


def restore_params(directory: str, model_cfg: ModelConfig, placement: ParamPlacement
                   ) -> nnx.State:
    """The params saved last in `directory` (`checkpointing.load_params`), restored
    straight onto the engine mesh in the model's own layout (the checkpoint's), each
    leaf sharded as `placement` places it; `placement.place` then lays it out."""
    import jax

    from dora_jax.model import checkpointing, transformer

    abstract = jax.tree.leaves(transformer.abstract_params(model_cfg)[1])
    like = jax.tree.unflatten(placement.source_treedef, [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        for a, s in zip(abstract, placement.source_shardings)])
    return checkpointing.load_params(directory, like)
