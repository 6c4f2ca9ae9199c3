"""Pod-scale efficiency of the model code, measured on this machine's compiler.

    python -m dora_jax.bench.scale

- Train-step memory: the compiled gradient of the policy's loss at T = 512 and
  T = 4096 tokens (XLA's memory analysis: temporaries + outputs), with blockwise
  attention and per-layer remat, against dense attention without remat.
- Compile time against depth: the train step's gradient at 4 and 32 layers, layers
  scanned, against the unrolled model (interleaved, repeated, median).

- Prefills per group: two groups of four samples decoded on one slice of the tiny
  config (configs/tiny.py); forward passes over prompts per group.

Ends with `train peak memory T=4096 / T=512: X` (blockwise + remat),
`compile time 32 layers / 4 layers: Y` (scanned) and `prefills per group: P`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from absl import app, flags

_REPS = flags.DEFINE_integer("reps", 3, "compilations per measurement (median)")


def _model_config(**overrides):
    from dora_jax.config import ModelConfig

    # Qwen3-like proportions at a size a CPU compiles quickly.
    base = ModelConfig(vocab_size=1024, d_model=256, num_layers=4, num_heads=8,
                       num_kv_heads=4, head_dim=32, mlp_hidden=768, attention_block=512)
    return dataclasses.replace(base, **overrides)


def _grad_fn(cfg):
    import jax
    import jax.numpy as jnp

    from dora_jax.model import transformer

    graphdef, params = transformer.abstract_params(cfg)

    def loss(params, tokens_BT):
        logits, _, _ = transformer.apply(graphdef, params, tokens_BT)
        return jnp.mean(transformer.token_logprobs(logits, tokens_BT))

    return jax.jit(jax.grad(loss)), params


def peak_bytes(cfg, T: int, batch: int = 1) -> int:
    """Temporaries + outputs of the compiled gradient at length T (no allocation)."""
    import jax
    import jax.numpy as jnp

    grad, params = _grad_fn(cfg)
    tokens = jax.ShapeDtypeStruct((batch, T), jnp.int32)
    mem = grad.lower(params, tokens).compile().memory_analysis()
    return mem.temp_size_in_bytes + mem.output_size_in_bytes


def compile_seconds(cfg, T: int = 128) -> float:
    import jax
    import jax.numpy as jnp

    grad, params = _grad_fn(cfg)
    tokens = jax.ShapeDtypeStruct((1, T), jnp.int32)
    start = time.perf_counter()
    grad.lower(params, tokens).compile()
    return time.perf_counter() - start


def prefills_per_group(groups: int = 2, group_size: int = 4) -> float:
    import jax
    from jax.sharding import Mesh
    import numpy as np

    from dora_jax import config as config_lib
    from dora_jax.bench import CONFIGS
    from dora_jax.model import transformer
    from dora_jax.rollout import DecodeSlice, Request

    cfg = config_lib.validate(config_lib.load(str(CONFIGS / "tiny.py")))
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), config_lib.SLICE_MESH_AXES)
    sl = DecodeSlice.create(0, mesh, cfg.model, cfg.rollout, rules=cfg.mesh.decode_rules)
    sl.load_version(0, transformer.create(cfg.model, 0)[1])
    for g in range(groups):
        for k in range(group_size):
            sl.submit(Request(group_id=g, prompt_id=str(g), sample_index=k, version=0,
                              prompt_tokens=[1, 5 + g, 7, 9], seed=100 * g + k))
    finished = sl.drain()
    assert len(finished) == groups * group_size
    return sl.stats.prefills / groups


def main(argv):
    del argv
    import jax

    jax.config.update("jax_enable_compilation_cache", False)  # measure compiles
    lines = []
    efficient = _model_config(attention="blockwise", remat="full")
    dense = _model_config(attention="dense", remat="none")
    mem = {(name, T): peak_bytes(cfg, T) for name, cfg in (("blockwise+remat", efficient),
                                                          ("dense", dense))
           for T in (512, 4096)}
    for name in ("blockwise+remat", "dense"):
        a, b = mem[(name, 512)], mem[(name, 4096)]
        print(f"{name:16} train step memory T=512 {a / 2**20:8.1f} MiB, T=4096 "
              f"{b / 2**20:8.1f} MiB, ratio {b / a:.1f}")
    lines.append(f"train peak memory T=4096 / T=512: "
                 f"{mem[('blockwise+remat', 4096)] / mem[('blockwise+remat', 512)]:.2f}")

    times = {}
    for _ in range(_REPS.value):  # interleaved
        for scan in (True, False):
            for depth in (4, 32):
                times.setdefault((scan, depth), []).append(
                    compile_seconds(_model_config(num_layers=depth, scan_layers=scan)))
    med = {k: statistics.median(v) for k, v in times.items()}
    for scan in (True, False):
        print(f"{'scanned' if scan else 'unrolled':16} compile 4 layers {med[(scan, 4)]:6.2f} s, "
              f"32 layers {med[(scan, 32)]:6.2f} s, ratio {med[(scan, 32)] / med[(scan, 4)]:.2f}")
    lines.append(f"compile time 32 layers / 4 layers: {med[(True, 32)] / med[(True, 4)]:.2f}")
    lines.append(f"prefills per group: {prefills_per_group():g}")
    print("\n".join(lines))


if __name__ == "__main__":
    app.run(main)
