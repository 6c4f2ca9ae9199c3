"""Benchmarks: each prints ratios measured side by side in one process.

Every benchmark is an absl program whose configs come from `--config=...` flags
(ml_collections' config_flags, as in `dora_jax.main`), with overrides
(`--config.rollout.slots_per_slice=16`). Defaults point into the package's configs
(dora_jax/configs, configs/ in a clone) so the commands work from any directory and
from an installed package.
"""

import json
import pathlib

from dora_jax import configs

CONFIGS = pathlib.Path(configs.DIR)

# The accelerator check's models (`bench.accelerator --size=device`, `bench.engine
# --shape=device`): a ~0.9B-parameter dense model and a 16-expert MoE in bfloat16; the
# dense one trains at 8K tokens a step. Sized so that compilation and the measured
# steps fit their shares on one H200.
DEVICE_DENSE = dict(vocab_size=32768, d_model=2048, num_layers=16, num_heads=16,
                    num_kv_heads=8, head_dim=128, mlp_hidden=5632, dtype="bfloat16",
                    param_dtype="bfloat16")
DEVICE_MOE = dict(vocab_size=32768, d_model=2048, num_layers=8, num_heads=16, num_kv_heads=4,
                  head_dim=128, mlp_hidden=5632, dtype="bfloat16", param_dtype="bfloat16")
# Their rollout: short prompts in one bucket, and the pages of 64 positions that the
# device configs (configs/moe.py, configs/qwen3_gsm8k.py) decode with.
DEVICE_ROLLOUT = dict(max_prefill_length=64, prefill_buckets=(64,), page_size=64)


def one_device_mesh():
    """A decode slice's mesh on the first device alone."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from dora_jax import config as config_lib

    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), config_lib.SLICE_MESH_AXES)


def write_figures(path: str, figures: dict) -> None:
    """A benchmark's figures as JSON (`--json_out`), for programs that read them
    (`bench.accelerator`); written whole, then renamed, so a reader never sees half."""
    if not path:
        return
    tmp = pathlib.Path(path + ".tmp")
    tmp.write_text(json.dumps(figures, indent=1))
    tmp.replace(path)


def model_shape(model_cfg, params) -> dict:
    """What the simulator's cost model needs of a model: its sizes and bytes."""
    import jax.numpy as jnp

    from dora_jax.model import transformer

    m = model_cfg
    total = transformer.count_params(params)
    active = total
    if m.moe.enabled:  # a token reads top_k of each MoE layer's experts
        moe_layers = sum(i % m.moe.moe_every == m.moe.moe_every - 1 for i in range(m.num_layers))
        unread = m.moe.num_experts - m.moe.top_k
        active = total - moe_layers * unread * 3 * m.d_model * m.moe.expert_hidden
    dtype_bytes = jnp.dtype(m.param_dtype).itemsize
    return dict(params=total, active_params=active, layers=m.num_layers, hidden=m.d_model,
                kv_bytes_per_token=m.num_layers * 2 * m.num_kv_heads * m.head_dim
                * jnp.dtype(m.dtype).itemsize,
                param_bytes=dtype_bytes, dtype=m.dtype, param_dtype=m.param_dtype,
                remat=m.remat)


def decode_bound(figures: dict, device_kind: str) -> dict | None:
    """Each KV layout's decode step with every slot busy against its bound: the ideal
    bytes (`step_bytes`) read at the device's memory bandwidth (public figures,
    `sim.device_fit.PEAKS`); None for a device without one (a CPU). `figures` is a
    `bench.engine` run's."""
    from dora_jax.sim import device_fit

    peaks = device_fit.PEAKS.get(device_kind)
    S = str(figures["slots"])
    seconds = {"dense": figures["step_seconds"][S], "paged": figures["paged_step_seconds"][S],
               **figures.get("paged_impl_step_seconds", {})}
    if peaks is None:
        print(f"   bound: no public memory bandwidth for {device_kind!r}; decode step at "
              f"{S} busy slots: " + ", ".join(f"{kv} {t * 1e3:.3f} ms"
                                              for kv, t in seconds.items()))
        return None
    out = {}
    for kv, step in seconds.items():
        ideal = figures["step_bytes"][kv]["ideal_bytes"] / peaks["hbm_bytes_per_s"]
        out[kv] = dict(step_seconds=step, bound_seconds=ideal, over_bound=step / ideal)
        print(f"   {kv} KV, {S} busy slots: {step * 1e3:.3f} ms a decode step, bound "
              f"{ideal * 1e3:.3f} ms (ideal bytes at {peaks['hbm_bytes_per_s'] / 1e12:.2f} "
              f"TB/s): {step / ideal:.2f}x the bound")
    return out
