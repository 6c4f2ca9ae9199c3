"""Placing a model's params on one engine's mesh: the check that a tree is the
model's, and its leaves moved to the decode shardings with every layer's arrays
apart (model/layer_layout.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dora_jax.config import ModelConfig
from dora_jax.model import layer_layout, lora, transformer
from dora_jax.model.sharding import Rules, param_shardings
from dora_jax.rollout.state import EngineParams

# The most bytes of the model's leaves a placement moves in their stacked layout at
# once (each chunk then cut into layers on the mesh): its peak beyond the result.
CHUNK_BYTES = 256 << 20


def _leaf_paths(params: nnx.State | dict[str, Any]) -> list[str]:
    """Leaf paths of an nnx.State or of its pure-dict form, alike."""
    return [jax.tree_util.keystr(p).removesuffix(".value")
            for p, _ in jax.tree_util.tree_leaves_with_path(params)]


class ParamPlacement:
    """The decode layout of a model's params on `mesh` under `rules`: every layer's
    arrays apart (`layer_layout.decode_config`), whatever the layout a version comes
    in (the model's own, stacked if `model_cfg.scan_layers`). `treedef`,
    `shardings`, `leaf_shapes` and `frozen` describe the decode layout;
    `source_treedef` and `source_shardings` the model's (a checkpoint's)."""

    def __init__(self, model_cfg: ModelConfig, mesh: Mesh, rules: Rules) -> None:
        source = transformer.abstract_params(model_cfg)[1]
        self.graphdef, abstract = transformer.abstract_params(
            layer_layout.decode_config(model_cfg))
        leaves, treedef = jax.tree.flatten(abstract)
        self.treedef = treedef
        self.source_treedef = jax.tree.structure(source)
        self._sources = layer_layout.sources(model_cfg)
        self._paths = _leaf_paths(source)
        # Trees whose leaf paths matched: flattening alone then identifies them (a
        # trainer publishes the same tree every step).
        self._known_trees = {self.source_treedef}
        self._source_shapes = [(x.shape, x.dtype) for x in jax.tree.leaves(source)]
        self._leaf_shapes = [(x.shape, x.dtype) for x in leaves]
        self.shardings = EngineParams(tuple(jax.tree.leaves(
            param_shardings(abstract, mesh, rules))))
        self.source_shardings = tuple(jax.tree.leaves(param_shardings(source, mesh, rules)))
        # With LoRA the base is frozen: a base leaf placed from the same source array
        # as last time (runtime/weights.py hands every version the one base) is not
        # moved again.
        adapted = lora.has_adapters(abstract)
        self._frozen = tuple(adapted and not lora._is_adapter(p)
                             for p, _ in jax.tree_util.tree_leaves_with_path(abstract))
        self._last: list = [None] * len(leaves)  # (source, placed) of frozen leaves
        self._cutters: dict[tuple, Callable] = {}
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self.last_bytes = 0  # moved by the latest `place`

    @property
    def frozen(self) -> tuple:
        """Per leaf: a LoRA base leaf, moved once (`place`), never again."""
        return self._frozen

    @property
    def leaf_shapes(self) -> list:
        """(shape, dtype) of each leaf, in the flattened order of EngineParams."""
        return list(self._leaf_shapes)

    def place(self, params: nnx.State | dict[str, Any] | EngineParams) -> EngineParams:
        """`params` on the mesh in the decode layout: the model's nnx.State or its pure
        dict (on any devices; each stacked leaf split into its layers), or
        EngineParams in the decode layout. EngineParams already placed here come back
        as they are; otherwise the leaves are moved with `jax.device_put`. Raises
        ValueError, naming a leaf, if the tree is not the model's."""
        if isinstance(params, EngineParams):
            leaves = list(params.leaves)
            if len(leaves) != len(self._leaf_shapes):
                raise ValueError(f"load_params: {len(leaves)} leaves, this model has "
                                 f"{len(self._leaf_shapes)}")
            _check_shapes(leaves, self._leaf_shapes)
            targets = list(self.shardings.leaves)
            if all(getattr(x, "sharding", None) == sh for x, sh in zip(leaves, targets)):
                self.last_bytes = 0
                return params
            sources = leaves
        else:
            source, treedef = jax.tree.flatten(params)
            if treedef not in self._known_trees:
                paths = _leaf_paths(params)
                if paths != self._paths:
                    diff = sorted(set(paths) ^ set(self._paths))[:3]
                    raise ValueError("load_params: params do not have this model's "
                                     f"structure ({len(source)} leaves, expected "
                                     f"{len(self._paths)}; differing paths e.g. {diff})")
                self._known_trees.add(treedef)
            _check_shapes(source, self._source_shapes)
            sources = [source[s.leaf] for s in self._sources]
        return self._put(sources, params)

    def _put(self, sources: list, params: object) -> EngineParams:
        """Decode leaf i from sources[i]: a whole leaf, or (from the model's tree) the
        layer `self._sources[i].layer` of a stacked leaf. A frozen leaf placed from
        the same source before is not moved again."""
        move = [i for i, x in enumerate(sources)
                if not (self._frozen[i] and self._last[i] is not None and self._last[i][0] is x)]
        out = [self._last[i][1] if self._frozen[i] and self._last[i] is not None else None
               for i in range(len(sources))]
        if isinstance(params, EngineParams):
            moved = jax.device_put([sources[i] for i in move],
                                   [self.shardings.leaves[i] for i in move])
        else:
            moved = self._laid_out(sources, move)
        for i, x in zip(move, moved):
            out[i] = x
            if self._frozen[i]:
                self._last[i] = (sources[i], x)
        self.last_bytes = sum(x.nbytes for x in moved)
        return EngineParams(tuple(out))

    def _laid_out(self, sources: list, move: list[int]) -> list:
        """Decode leaves `move` from the model's leaves. In host memory (numpy, or a
        CPU backend's arrays: a CPU trainer's publish, a run's first params) they go
        packed, one flat buffer per dtype in one `jax.device_put`, and one program cuts
        the layers out of it (a transfer per leaf costs host time per leaf, which the
        runtime's other threads wait for). On an accelerator each leaf is moved to the
        mesh once, in its own (stacked) layout, and cut apart there by one program,
        in chunks of at most CHUNK_BYTES of the model's leaves, so that the stacked
        copies a placement holds at once stay bounded."""
        out: dict[int, jax.Array] = {}
        on_host = [i for i in move if _in_host_memory(sources[i])]
        for dtype in sorted({np.dtype(sources[i].dtype).str for i in on_host}):
            leaves = tuple(i for i in on_host if np.dtype(sources[i].dtype).str == dtype)
            model = {self._sources[i].leaf: sources[i] for i in leaves}
            flat = np.concatenate([np.ravel(np.asarray(x)) for x in model.values()])
            unpack = self._unpacker(leaves, tuple(model))
            out.update(zip(leaves, unpack(jax.device_put(flat, self._replicated))))
        on_device = [i for i in move if i not in out]
        if on_device:
            out.update(self._cut_on_mesh(sources, on_device))
        return [out[i] for i in move]

    def _unpacker(self, leaves: tuple[int, ...], model: tuple[int, ...]) -> Callable:
        """The program cutting decode leaves `leaves` out of the model's leaves `model`
        packed flat in that order."""
        key = ("packed", leaves, model)
        if key not in self._cutters:
            start, offset = {}, 0
            for leaf in model:
                start[leaf] = offset
                offset += math.prod(self._source_shapes[leaf][0])
            where = []
            for i in leaves:
                source, shape = self._sources[i], self._leaf_shapes[i][0]
                size = math.prod(shape)
                where.append((start[source.leaf] + (source.layer or 0) * size, size, shape))
            self._cutters[key] = jax.jit(
                lambda flat: [flat[o:o + n].reshape(shape) for o, n, shape in where],
                out_shardings=[self.shardings.leaves[i] for i in leaves])
        return self._cutters[key]

    def _cut_on_mesh(self, sources: list, move: list[int]) -> dict[int, jax.Array]:
        model_leaf = {self._sources[i].leaf: sources[i] for i in move}
        chunks: list[list[int]] = [[]]
        size = 0
        for leaf, x in model_leaf.items():
            if chunks[-1] and size + x.nbytes > CHUNK_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append(leaf)
            size += x.nbytes
        out: dict[int, jax.Array] = {}
        for chunk in chunks:
            placed = dict(zip(chunk, jax.device_put([model_leaf[leaf] for leaf in chunk], [
                self.source_shardings[leaf] for leaf in chunk])))
            cut = [i for i in move if self._sources[i].leaf in placed
                   and self._sources[i].layer is not None]
            out.update((i, placed[self._sources[i].leaf]) for i in move
                       if self._sources[i].leaf in placed and self._sources[i].layer is None)
            if cut:
                stacks = sorted({self._sources[i].leaf for i in cut})
                out.update(zip(cut, self._cutter(tuple(cut), tuple(stacks))(
                    [placed[leaf] for leaf in stacks])))
        return out

    def _cutter(self, cut: tuple[int, ...], stacks: tuple[int, ...]) -> Callable:
        """The program that cuts decode leaves `cut` out of the stacked leaves `stacks`
        (one jitted program per such set: the whole model's, or its adapters')."""
        key = ("stacked", cut, stacks)
        if key not in self._cutters:
            position = {leaf: k for k, leaf in enumerate(stacks)}
            where = [(position[self._sources[i].leaf], self._sources[i].layer) for i in cut]
            self._cutters[key] = jax.jit(
                lambda xs: [xs[k][layer] for k, layer in where],
                out_shardings=[self.shardings.leaves[i] for i in cut])
        return self._cutters[key]


def _in_host_memory(x: Any) -> bool:
    return isinstance(x, np.ndarray) or (
        isinstance(x, jax.Array) and all(d.platform == "cpu" for d in x.devices()))


def _check_shapes(leaves: list, expected: list) -> None:
    for i, (x, (shape, dtype)) in enumerate(zip(leaves, expected)):
        if x.shape != shape or x.dtype != dtype:
            raise ValueError(f"load_params: leaf {i} is {x.dtype}{list(x.shape)}, the "
                             f"model expects {dtype}{list(shape)}")
