"""Params laid out for decoding: one array per layer.

The trainer scans its layers over stacked params (`scan_layers`: `blocks[r]` holds
layers r, r + p, r + 2p, ... on a leading axis, one compiled period); its checkpoints
keep that layout. A decode step that scanned them would slice each layer's weights
out of the stack before its matmuls, a copy of every weight per token. A decode
slice instead holds each layer's params as arrays of their own (`decode_config`: the
same model unscanned), laid out once, when a version is placed on it
(rollout/placement.py).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
from flax import nnx
from jax.tree_util import DictKey

from dora_jax.config import ModelConfig
from dora_jax.model import transformer


def decode_config(cfg: ModelConfig) -> ModelConfig:
    """The model as a decode slice holds it: every layer's params apart."""
    return dataclasses.replace(cfg, scan_layers=False)


class Source(NamedTuple):
    """Where a per-layer leaf comes from: the model's leaf `leaf` (in flattened
    order), and `layer`, its index along that leaf's stacked axis (None: the leaf
    itself)."""

    leaf: int
    layer: int | None


def sources(cfg: ModelConfig) -> tuple[Source, ...]:
    """For each leaf of `decode_config(cfg)`'s params, in flattened order, its
    source among `cfg`'s."""
    model = jax.tree_util.tree_flatten_with_path(transformer.abstract_params(cfg)[1])[0]
    per_layer = jax.tree_util.tree_flatten_with_path(
        transformer.abstract_params(decode_config(cfg))[1])[0]
    index = {path: i for i, (path, _) in enumerate(model)}
    p = cfg.layer_period
    out = []
    for path, _ in per_layer:
        if cfg.scan_layers and path[0] == DictKey("blocks"):
            layer = path[1].key  # type: ignore[attr-defined]  # blocks' keys are DictKeys
            out.append(Source(index[(path[0], DictKey(layer % p), *path[2:])], layer // p))
        else:
            out.append(Source(index[path], None))
    return tuple(out)


def unstack(cfg: ModelConfig, params: nnx.State) -> nnx.State:
    """`params` of the model `cfg` (stacked if it scans its layers) as
    `decode_config(cfg)`'s, each layer's arrays apart."""
    leaves = jax.tree.leaves(params)
    treedef = jax.tree.structure(transformer.abstract_params(decode_config(cfg))[1])
    return jax.tree.unflatten(treedef, [
        leaves[s.leaf] if s.layer is None else leaves[s.leaf][s.layer] for s in sources(cfg)])
