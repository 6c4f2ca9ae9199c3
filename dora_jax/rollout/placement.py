"""Placing a model's params on one engine's mesh: the check that a tree is the
model's, and one `jax.device_put` of its leaves to the decode shardings."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from dora_jax.model import lora
from dora_jax.model.sharding import Rules, param_shardings
from dora_jax.rollout.state import EngineParams


def _leaf_paths(params: nnx.State | dict[str, Any]) -> list[str]:
    """Leaf paths of an nnx.State or of its pure-dict form, alike."""
    return [jax.tree_util.keystr(p).removesuffix(".value")
            for p, _ in jax.tree_util.tree_leaves_with_path(params)]


class ParamPlacement:
    """The decode shardings of a model's params on `mesh` under `rules`.

    abstract: the model's param tree of shapes (transformer.abstract_params).
    """

    def __init__(self, abstract: nnx.State, mesh: Mesh, rules: Rules) -> None:
        leaves, treedef = jax.tree.flatten(abstract)
        self.treedef = treedef
        self._paths = _leaf_paths(abstract)
        # Trees whose leaf paths matched: flattening alone then identifies them (a
        # trainer publishes the same tree every step).
        self._known_trees = {treedef}
        self._leaf_shapes = [(x.shape, x.dtype) for x in leaves]
        self.shardings = EngineParams(tuple(jax.tree.leaves(
            param_shardings(abstract, mesh, rules))))
        # With LoRA the base is frozen: a base leaf placed from the same source array
        # as last time (runtime/weights.py hands every version the one base) is not
        # moved again.
        adapted = lora.has_adapters(abstract)
        self._frozen = tuple(adapted and not lora._is_adapter(p)
                             for p, _ in jax.tree_util.tree_leaves_with_path(abstract))
        self._last: list = [None] * len(leaves)  # (source, placed) of frozen leaves
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
        """`params` (an nnx.State, its pure dict, or EngineParams; on any devices) on
        the mesh. EngineParams already placed there come back as they are; otherwise
        the leaves go in one `jax.device_put`. Raises ValueError, naming a leaf, if
        the tree is not the model's."""
        if isinstance(params, EngineParams):
            leaves = list(params.leaves)
            if len(leaves) != len(self._paths):
                raise ValueError(f"load_params: {len(leaves)} leaves, this model has "
                                 f"{len(self._paths)}")
        else:
            leaves, treedef = jax.tree.flatten(params)
            if treedef not in self._known_trees:
                paths = _leaf_paths(params)
                if paths != self._paths:
                    diff = sorted(set(paths) ^ set(self._paths))[:3]
                    raise ValueError("load_params: params do not have this model's "
                                     f"structure ({len(leaves)} leaves, expected "
                                     f"{len(self._paths)}; differing paths e.g. {diff})")
                self._known_trees.add(treedef)
        for i, (x, (shape, dtype)) in enumerate(zip(leaves, self._leaf_shapes)):
            if x.shape != shape or x.dtype != dtype:
                raise ValueError(f"load_params: leaf {i} is {x.dtype}{list(x.shape)}, the "
                                 f"model expects {dtype}{list(shape)}")
        targets = list(self.shardings.leaves)
        if isinstance(params, EngineParams) and all(
                getattr(x, "sharding", None) == sh for x, sh in zip(leaves, targets)):
            self.last_bytes = 0
            return params
        move = [i for i, x in enumerate(leaves)
                if not (self._frozen[i] and self._last[i] is not None and self._last[i][0] is x)]
        moved = jax.device_put([leaves[i] for i in move], [targets[i] for i in move])
        out = [self._last[i][1] if self._frozen[i] and self._last[i] is not None else None
               for i in range(len(leaves))]
        for i, x in zip(move, moved):
            out[i] = x
            if self._frozen[i]:
                self._last[i] = (leaves[i], x)
        self.last_bytes = lora.tree_bytes([leaves[i] for i in move])
        return EngineParams(tuple(out))
