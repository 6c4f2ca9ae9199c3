"""Placing a model's params on one engine's mesh: the check that a tree is the
model's, its layers laid out apart for decoding (model/layer_layout.py), and one
`jax.device_put` of the leaves to the decode shardings."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from dora_jax.config import ModelConfig
from dora_jax.model import layer_layout, lora, transformer
from dora_jax.model.sharding import Rules, param_shardings
from dora_jax.rollout.state import EngineParams


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
        the same source before is not moved again. The layers of one stacked leaf are
        cut and moved together, so at most one leaf's worth is cut at a time."""
        stacked = not isinstance(params, EngineParams)
        groups: dict[int, list[int]] = {}
        for i, x in enumerate(sources):
            if not (self._frozen[i] and self._last[i] is not None and self._last[i][0] is x):
                cut_from = self._sources[i].leaf if stacked and self._sources[i].layer is not None \
                    else -1  # whole leaves: all in one group
                groups.setdefault(cut_from, []).append(i)
        out = [self._last[i][1] if self._frozen[i] and self._last[i] is not None else None
               for i in range(len(sources))]
        moved_bytes = 0
        for group in groups.values():
            cut = [sources[i] if not stacked or self._sources[i].layer is None
                   else sources[i][self._sources[i].layer] for i in group]
            for i, x in zip(group, jax.device_put(cut, [self.shardings.leaves[i] for i in group])):
                out[i] = x
                moved_bytes += x.nbytes
                if self._frozen[i]:
                    self._last[i] = (sources[i], x)
        self.last_bytes = moved_bytes
        return EngineParams(tuple(out))


def _check_shapes(leaves: list, expected: list) -> None:
    for i, (x, (shape, dtype)) in enumerate(zip(leaves, expected)):
        if x.shape != shape or x.dtype != dtype:
            raise ValueError(f"load_params: leaf {i} is {x.dtype}{list(x.shape)}, the "
                             f"model expects {dtype}{list(shape)}")
