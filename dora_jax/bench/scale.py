"""Pod-scale efficiency of the model code, measured on this machine's compiler.

    python -m dora_jax.bench.scale

- Train-step memory: the compiled gradient of the policy's loss at T = 512 and
  T = 4096 tokens (XLA's memory analysis: temporaries + outputs), with blockwise
  attention and per-layer remat, against dense attention without remat.
- Compile time against depth: the train step's gradient at 4 and 32 layers, layers
  scanned, against the unrolled model (interleaved, repeated, median).

- Decode throughput at long-tail contexts: S slots of a 4,096-token cache, each at
  a context drawn from a long-tailed (log-normal) distribution with the paper's
  mean/max proportions (mean 2.4K of 30K, here ~330 of 4,096), every slot busy;
  generate calls on the paged cache against the dense one (interleaved, repeated,
  median).
- Concurrent samples at equal KV memory: a dense slice of `--dense_slots` slots of
  4,096 positions against a paged slice whose pool holds the same number of
  positions and has `--paged_slots` slots, both fed the same stream of requests
  whose lengths follow that distribution (`Request.max_new_tokens`); mean running
  requests per decode step once warm.
- Prefills per group: two groups of four samples decoded on one slice of the tiny
  config (configs/tiny.py); forward passes over prompts per group.

Ends with `train peak memory T=4096 / T=512: X` (blockwise + remat),
`compile time 32 layers / 4 layers: Y` (scanned), `decode tokens/s paged/dense at
long-tail contexts: Z`, `concurrent samples per slice at equal KV memory,
paged/dense: W` and `prefills per group: P`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from absl import app, flags

from dora_jax.bench import CONFIGS, one_device_mesh

_REPS = flags.DEFINE_integer("reps", 3, "repeats per measurement (median)")
_SLOTS = flags.DEFINE_integer("decode_slots", 16, "slots in the decode-throughput run")
_DENSE_SLOTS = flags.DEFINE_integer("dense_slots", 4, "slots of the dense slice")
_PAGED_SLOTS = flags.DEFINE_integer("paged_slots", 64, "slots of the paged slice")
_CONC_STEPS = flags.DEFINE_integer("concurrency_steps", 1500,
                                   "decode steps per slice (the first third warms up)")
_PARTS = flags.DEFINE_list("parts", ["memory", "compile", "decode", "concurrency", "prefill"],
                           "which measurements to run")

CACHE = 4096


def longtail_lengths(n: int, rng, cap: int = CACHE):
    """Lengths with the paper's shape (mean 2.4K, max 30K in a 30K budget) scaled to
    a `cap`-token cache: log-normal, median 200, sigma 1 (mean ~330), clipped."""
    import numpy as np

    return np.clip(rng.lognormal(np.log(200), 1.0, n), 16, cap).astype(int)


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


def _rollout(slots, kv_cache, max_prefill, max_decode, kv_pages=0, decode_steps=16):
    from dora_jax.base.buckets import doubling_buckets
    from dora_jax.config import RolloutConfig

    return RolloutConfig(slots_per_slice=slots, max_prefill_length=max_prefill,
                         max_decode_len=max_decode, decode_steps=decode_steps,
                         prefill_buckets=doubling_buckets((16,), max_prefill), eos_id=-1,
                         kv_cache=kv_cache, kv_pages=kv_pages)


def decode_tokens_per_second(reps: int, slots: int, calls: int = 4) -> dict:
    """{layout: median tokens/s} of generate calls with every slot at a long-tail
    context (see the module docstring); both layouts decode the same slots."""
    import jax
    import numpy as np

    from dora_jax.model import transformer
    from dora_jax.rollout import Engine

    cfg = _model_config(attention="blockwise")
    params = transformer.create(cfg, 0)[1]
    max_decode = 256
    rng = np.random.default_rng(0)
    contexts = longtail_lengths(slots, rng, CACHE - max_decode)
    print(f"decode contexts: mean {contexts.mean():.0f}, max {contexts.max()}, "
          f"{slots} slots, cache {CACHE}")
    runs = {}
    for layout in ("paged", "dense"):
        eng = Engine(cfg, _rollout(slots, layout, CACHE - max_decode, max_decode),
                     one_device_mesh())
        p = eng.load_params(params)
        state = eng.init_decode_state()
        for slot, c in enumerate(contexts):
            tokens = np.random.default_rng(slot).integers(2, cfg.vocab_size, c)
            padded, n = eng.pad_tokens(tokens)
            prefix, _ = eng.prefill(params=p, padded_tokens=padded, true_length=n, rng=slot)
            state = eng.insert(prefix, state, slot, length=n)
        state, _ = eng.generate_steps(p, state)  # compile
        runs[layout] = [eng, p, jax.block_until_ready(state)]
    times: dict[str, list[float]] = {layout: [] for layout in runs}
    for _ in range(reps):  # interleaved
        for layout, run in runs.items():
            eng, p, state = run
            start = time.perf_counter()
            for _ in range(calls):
                state, result = eng.generate_steps(p, state)
            steps = int(np.asarray(result.valid).any(axis=1).sum())
            assert steps == eng.decode_steps  # nothing finished: every slot busy
            run[2] = jax.block_until_ready(state)
            times[layout].append(slots * calls * steps / (time.perf_counter() - start))
    return {layout: statistics.median(t) for layout, t in times.items()}


def concurrent_samples(layout: str, slots: int, pool_tokens: int, steps: int) -> float:
    """Mean running requests per decode step of one slice (after the first third of
    `steps`), fed long-tail requests as fast as it takes them."""
    import numpy as np

    from dora_jax.model import transformer
    from dora_jax.rollout import DecodeSlice, Request

    cfg = _model_config(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        mlp_hidden=128)
    prompt = 16
    rollout = _rollout(slots, layout, prompt, CACHE - prompt,
                       kv_pages=pool_tokens // 16 if layout == "paged" else 0)
    sl = DecodeSlice.create(0, one_device_mesh(), cfg, rollout)
    sl.load_version(0, transformer.create(cfg, 0)[1])
    rng = np.random.default_rng(1)
    lengths = iter(longtail_lengths(100_000, rng, CACHE - prompt))
    n, warm = 0, None
    while sl.stats.generate_steps < steps:
        while sl.num_free_slots:
            sl.submit(Request(group_id=n, prompt_id=n, sample_index=0, version=0,
                              prompt_tokens=tuple(rng.integers(2, cfg.vocab_size, prompt)),
                              seed=n, max_new_tokens=int(next(lengths))))
            n += 1
        sl.step()
        if warm is None and sl.stats.generate_steps >= steps // 3:
            warm = (sl.stats.generate_steps, sl.stats.busy_slot_steps)
    if layout == "paged":
        print(f"paged slice: peak pages {sl.stats.peak_pages} of {rollout.pool_pages}, "
              f"{sl.stats.preempted} preemptions, {sl.stats.finished} finished")
    assert warm is not None  # set once a third of the steps had run
    return (sl.stats.busy_slot_steps - warm[1]) / (sl.stats.generate_steps - warm[0])


def prefills_per_group(groups: int = 2, group_size: int = 4) -> float:
    from dora_jax import config as config_lib
    from dora_jax.model import transformer
    from dora_jax.rollout import DecodeSlice, Request

    cfg = config_lib.validate(config_lib.load(str(CONFIGS / "tiny.py")))
    sl = DecodeSlice.create(0, one_device_mesh(), cfg.model, cfg.rollout,
                            rules=cfg.mesh.decode_rules)
    sl.load_version(0, transformer.create(cfg.model, 0)[1])
    for g in range(groups):
        for k in range(group_size):
            sl.submit(Request(group_id=g, prompt_id=str(g), sample_index=k, version=0,
                              prompt_tokens=(1, 5 + g, 7, 9), seed=100 * g + k))
    finished = sl.drain()
    assert len(finished) == groups * group_size
    return sl.stats.prefills / groups


def main(argv):
    del argv
    import jax

    jax.config.update("jax_enable_compilation_cache", False)  # measure compiles
    lines, parts = [], set(_PARTS.value)
    if "memory" in parts:
        lines.append(_memory_line())
    if "compile" in parts:
        lines.append(_compile_line())
    if "decode" in parts:
        tps = decode_tokens_per_second(_REPS.value, _SLOTS.value)
        print(f"decode tokens/s: paged {tps['paged']:.0f}, dense {tps['dense']:.0f}")
        lines.append(f"decode tokens/s paged/dense at long-tail contexts: "
                     f"{tps['paged'] / tps['dense']:.2f}")
    if "concurrency" in parts:
        d = _DENSE_SLOTS.value
        conc = {layout: concurrent_samples(layout, slots, d * CACHE, _CONC_STEPS.value)
                for layout, slots in (("dense", d), ("paged", _PAGED_SLOTS.value))}
        print(f"concurrent samples at {d * CACHE} KV positions: paged {conc['paged']:.1f} "
              f"({_PAGED_SLOTS.value} slots), dense {conc['dense']:.1f} ({d} slots)")
        lines.append(f"concurrent samples per slice at equal KV memory, paged/dense: "
                     f"{conc['paged'] / conc['dense']:.2f}")
    if "prefill" in parts:
        lines.append(f"prefills per group: {prefills_per_group():g}")
    print("\n".join(lines))


def _memory_line() -> str:
    efficient = _model_config(attention="blockwise", remat="full")
    dense = _model_config(attention="dense", remat="none")
    mem = {(name, T): peak_bytes(cfg, T) for name, cfg in (("blockwise+remat", efficient),
                                                          ("dense", dense))
           for T in (512, 4096)}
    for name in ("blockwise+remat", "dense"):
        a, b = mem[(name, 512)], mem[(name, 4096)]
        print(f"{name:16} train step memory T=512 {a / 2**20:8.1f} MiB, T=4096 "
              f"{b / 2**20:8.1f} MiB, ratio {b / a:.1f}")
    return (f"train peak memory T=4096 / T=512: "
            f"{mem[('blockwise+remat', 4096)] / mem[('blockwise+remat', 512)]:.2f}")


def _compile_line() -> str:
    times: dict[tuple[bool, int], list[float]] = {}  # (scanned, layers) -> seconds
    for _ in range(_REPS.value):  # interleaved
        for scan in (True, False):
            for depth in (4, 32):
                times.setdefault((scan, depth), []).append(
                    compile_seconds(_model_config(num_layers=depth, scan_layers=scan)))
    med = {k: statistics.median(v) for k, v in times.items()}
    for scan in (True, False):
        print(f"{'scanned' if scan else 'unrolled':16} compile 4 layers {med[(scan, 4)]:6.2f} s, "
              f"32 layers {med[(scan, 32)]:6.2f} s, ratio {med[(scan, 32)] / med[(scan, 4)]:.2f}")
    return f"compile time 32 layers / 4 layers: {med[(True, 32)] / med[(True, 4)]:.2f}"


if __name__ == "__main__":
    app.run(main)
