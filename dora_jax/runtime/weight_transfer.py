"""A version's params from the trainer's process to a slice process, device to device
over JAX's transfer server (`jax.experimental.transfer`), never through Python.

The trainer's lead stages the params on a block of its own devices shaped as a decode
slice's mesh, with the slice's decode shardings (`ParamPlacement`), and offers them
under a number; the slice process pulls that number into the same shardings on its
own mesh, shard by shard. With LoRA a slice pulls the frozen base once and then only
the adapters.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import jax
import numpy as np
from jax.experimental import transfer
from jax.sharding import Mesh

from dora_jax.config import SLICE_MESH_AXES
from dora_jax.rollout.engine import EngineParams
from dora_jax.rollout.placement import ParamPlacement


def start_server(host: str) -> transfer.TransferServer:
    client = jax.local_devices()[0].client
    return transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])


def staging_mesh(trainer_devices: list, slice_shape: tuple) -> Mesh:
    """A decode slice's mesh shape over the first of the trainer's devices."""
    n = int(np.prod(slice_shape))
    if n > len(trainer_devices):
        raise ValueError(f"a decode slice has {n} devices, more than the trainer's "
                         f"{len(trainer_devices)}: the trainer stages a version on a block "
                         "of its own devices shaped as a slice")
    return Mesh(np.array(trainer_devices[:n], dtype=object).reshape(slice_shape),
                SLICE_MESH_AXES)


class WeightOffers:
    """The lead's side: stages a version once and offers it to each puller."""

    def __init__(self, placement: ParamPlacement, host: str) -> None:
        self._placement = placement  # on the staging mesh
        self._server = start_server(host)
        self.address = self._server.address()
        self._numbers = itertools.count(1)
        self._staged: dict[int, EngineParams] = {}  # version -> params on the staging mesh
        self._lock = threading.Lock()
        self.frozen = [bool(f) for f in placement.frozen]
        self.offered_bytes = 0

    def offer(self, version: int, params: Any, *, base_held: bool) -> tuple[int, list[int]]:
        """Offers `version` (`params` on any devices) to one pull: (number, indices of
        the leaves offered). `base_held`: the puller keeps a frozen base already."""
        with self._lock:
            staged = self._staged.get(version)
            if staged is None:
                staged = self._placement.place(params)
                self._staged = {v: p for v, p in self._staged.items() if v > version - 4}
                self._staged[version] = staged
            leaves = [i for i, frozen in enumerate(self.frozen) if not (frozen and base_held)]
            number = next(self._numbers)
            arrays = [staged.leaves[i] for i in leaves]
            self._server.await_pull(number, arrays)
            self.offered_bytes += sum(x.nbytes for x in arrays)
        return number, leaves


class WeightPuller:
    """A slice process's side: pulls offered versions into one slice's shardings."""

    def __init__(self, placement: ParamPlacement, server: transfer.TransferServer,
                 address: str) -> None:
        self._conn = server.connect(address)
        self._specs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                       for (shape, dtype), sharding in zip(placement.leaf_shapes,
                                                           placement.shardings.leaves)]
        self._held: list = [None] * len(self._specs)
        self.frozen = [bool(f) for f in placement.frozen]

    @property
    def base_held(self) -> bool:
        return all(x is not None for x, f in zip(self._held, self.frozen) if f)

    def pull(self, number: int, leaves: list[int]) -> EngineParams:
        got = self._conn.pull(number, [self._specs[i] for i in leaves])
        held = list(self._held)
        for i, x in zip(leaves, got):
            held[i] = x
        if any(x is None for x in held):
            raise ValueError(f"pull {number} left {sum(x is None for x in held)} leaves unset")
        self._held = held
        return EngineParams(tuple(held))
