"""Decode throughput: DecodeSlice (continuous batching) vs a fixed-batch while_loop.

    python -m dora_jax.bench.engine [--models=tiny,moe] [--slots=8,32] [--decode_len=128]

Runs on one device (the first). For each model (`--config`, default configs/tiny.py;
`--moe_config`, default configs/moe.py:tiny) and the same requests (same prompts,
seeds, hence the same tokens and lengths — the RNG is per request):
  1. all slots busy: EOS disabled, every request runs max_decode_len tokens; the
     slice keeps its S slots full by refilling freed slots, the fixed-batch sampler
     runs batches of S requests, each as one jitted `lax.while_loop`;
  2. long-tailed lengths: EOS set to the token the model emits most often, so
     lengths are roughly geometric; the fixed batch waits for its longest request;
  3. slice time per decode step as a function of busy slots 1..S;
and, for the dense and the paged KV cache, the bytes a compiled decode step accesses
(XLA's cost analysis) next to the ideal: the weights read once plus the KV cache; and
each layout's step time with every slot busy against its bound, the ideal bytes at the
device's memory bandwidth (on a device with public figures: not a CPU).
`--paged_attention=pallas_gpu` (say) also measures the paged layout with that
implementation beside the config's.
First, a sweep of `rollout.decode_steps` (tokens per generate call) with all slots
busy shows what the configs' default is chosen from.
Both samplers use the engine's prefill/insert and its decode step (`generate_fn`),
so the difference is the loop: host-driven continuous batching vs one device loop
(both on the dense KV cache, which a plain device loop can decode without page
tables).
`--profile` instead runs the first model at the largest S, all slots busy, and prints
where a decode step's time goes: seconds per step, then a profiler trace of the same
steps with the device's kernels summed by name (none on a CPU). `--shape=device`
gives both models bench.accelerator's device shapes (a 0.9B dense, a 16-expert MoE,
bfloat16, pages of 64; `--dtype=float32` on a CPU). `--bytes_only` prints each KV
layout's decode-step bytes against the ideal and times nothing.

Ends with `slice/fixed-batch tokens/s ratio: X.XX` for the all-busy case: the lower
of the two models at the largest slot count (`--slots`, default 8 — the configs' —
and 32; at S=8 a tiny model's decode step is a few hundred microseconds, so fixed
per-call costs weigh more than they do at realistic step times). Timings are the best
of `--repeats` interleaved runs.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from dora_jax.bench import (
    CONFIGS,
    DEVICE_DENSE,
    DEVICE_MOE,
    DEVICE_ROLLOUT,
    decode_bound,
    kernels,
    model_shape,
    one_device_mesh,
    write_figures,
)
from dora_jax.model import hf_checks, paged_attention, transformer
from dora_jax.rollout import DecodeSlice, Engine, Request
from dora_jax.rollout.step_cost import step_cost

_MODEL_CONFIGS = {
    "tiny": config_flags.DEFINE_config_file("config", str(CONFIGS / "tiny.py"),
                                            "the dense model's config"),
    "moe": config_flags.DEFINE_config_file("moe_config", str(CONFIGS / "moe.py") + ":tiny",
                                           "the MoE model's config"),
}
_MODELS = flags.DEFINE_list("models", ["tiny", "moe"], "which of the two configs to run")
_SLOTS = flags.DEFINE_list("slots", ["8", "32"],
                           "slot counts S; the configs' is 8, the final ratio uses the largest")
_DECODE_LEN = flags.DEFINE_integer("decode_len", 128, "max_decode_len of the benchmark")
_PER_SLOT = flags.DEFINE_integer("requests_per_slot", 4, "requests per slot")
# Each timing is a burst of a fraction of a second on cores the host shares: at 3
# repeats the same tree's ratio read 0.89 to 0.95 on a 2-core host, at 7 0.95 twice.
_REPEATS = flags.DEFINE_integer("repeats", 7, "interleaved repeats (best is kept)")
_SWEEP = flags.DEFINE_list("sweep", ["1", "2", "4", "8", "16"],
                           "decode_steps values compared first (all slots busy, first "
                           "model, largest S); empty to skip")
_PROFILE = flags.DEFINE_bool("profile", False, "profile the decode step instead (see above)")
_SHAPE = flags.DEFINE_enum("shape", "config", ["config", "device"],
                           "models: the configs', or bench.accelerator's device shapes")
_DTYPE = flags.DEFINE_string("dtype", "", "activations and params in this dtype (e.g. float32 "
                             "for the device shapes on a CPU, whose backend converts each "
                             "bfloat16 weight to float32 before its matmul)")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 0, "positions per KV page (0: the config's, or "
                                  "with --shape=device the device configs' 64)")
_BYTES_ONLY = flags.DEFINE_bool("bytes_only", False, "print each layout's decode-step bytes "
                                "against the ideal at each --slots, and time nothing")
_JSON_OUT = flags.DEFINE_string("json_out", "", "also write the figures to this JSON file")
_PAGED_IMPLS = flags.DEFINE_list(
    "paged_attention", [], "paged attention implementations to time beside the config's "
    "(`paged/<impl>` in the figures), e.g. ragged,pallas_gpu on a GPU")


def model_config(name: str):
    """The model's validated config, in bench.accelerator's device shape with
    `--shape=device`."""
    c = _MODEL_CONFIGS[name].value
    if _SHAPE.value == "device":
        c.model.update(DEVICE_DENSE if name == "tiny" else DEVICE_MOE)
        if name == "moe":
            c.model.moe.update(dict(num_experts=16, top_k=2, expert_hidden=1408))
        c.rollout.update(DEVICE_ROLLOUT)
        c.trainer.length_buckets = (512,)
    if _DTYPE.value:
        c.model.update(dict(dtype=_DTYPE.value, param_dtype=_DTYPE.value))
    if _PAGE_SIZE.value:
        c.rollout.page_size = _PAGE_SIZE.value
    return hf_checks.validated(c)


def make_requests(n: int, max_prompt: int, vocab: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [Request(group_id=i, prompt_id=i, sample_index=0,
                    prompt_tokens=tuple(rng.integers(2, vocab, rng.integers(4, max_prompt + 1))),
                    seed=1000 + i, version=0) for i in range(n)]


def run_slice(sl: DecodeSlice, requests: list):
    """Continuous batching: keep every slot busy while requests remain."""
    queue, out = list(requests), []
    t0 = time.perf_counter()
    while queue or sl.num_requests:
        while queue and sl.num_free_slots:
            sl.submit(queue.pop(0))
        out.extend(sl.step())
    seconds = time.perf_counter() - t0
    return seconds, {t.group_id: t.response_tokens for t in out}


def make_fixed_batch(engine: Engine):
    """A plain sampler: prefill S requests, then one jitted while_loop decodes until
    every one of them finished; tokens come back in a single transfer per batch."""
    S, D = engine.max_concurrent_decodes, engine.max_decode_len

    def loop(params, state):
        def body(carry):
            state, tokens_SD, logprobs_SD = carry
            state, res = engine.generate_fn(params, state)
            rows, valid = jnp.arange(S), res.valid
            tokens_SD = tokens_SD.at[rows, res.steps].set(
                jnp.where(valid, res.tokens, tokens_SD[rows, res.steps]))
            logprobs_SD = logprobs_SD.at[rows, res.steps].set(
                jnp.where(valid, res.logprobs, logprobs_SD[rows, res.steps]))
            return state, tokens_SD, logprobs_SD

        init = (state, jnp.zeros((S, D), jnp.int32), jnp.zeros((S, D), jnp.float32))
        return jax.lax.while_loop(lambda c: jnp.any(c[0].active), body, init)

    loop_jit = jax.jit(loop, donate_argnums=(1,))

    def run(params, requests):
        t0 = time.perf_counter()
        out = {}
        for b in range(0, len(requests), S):
            batch = requests[b:b + S]
            state, firsts = engine.init_decode_state(), []
            for slot, r in enumerate(batch):
                padded, n = engine.pad_tokens(r.prompt_tokens)
                prefix, first = engine.prefill(params=params, padded_tokens=padded,
                                               true_length=n, rng=r.key_data())
                state = engine.insert(prefix, state, slot)
                firsts.append(first)
            state, tokens_SD, logprobs_SD = loop_jit(params, state)
            tokens_SD, _, firsts = jax.device_get((tokens_SD, logprobs_SD, firsts))
            for slot, (r, f) in enumerate(zip(batch, firsts)):
                row = [int(f.tokens[0])] + tokens_SD[slot, 1:].tolist()
                stops = [i for i, t in enumerate(row) if t in engine.stop_ids]
                out[r.group_id] = row[:stops[0] + 1 if stops else D]
        return time.perf_counter() - t0, out

    return run


def best_of_interleaved(repeats: int, *fns):
    """Runs the fns in turn `repeats` times (so load changes hit all alike); returns
    each one's fastest (seconds, output)."""
    best: list = [None] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            r = fn()
            if best[i] is None or r[0] < best[i][0]:
                best[i] = r
    return best


def step_time(sl: DecodeSlice, requests: list) -> float:
    """Mean seconds per decode step with len(requests) busy slots (after prefill),
    over the requests' whole length (several steps per `step()` call)."""
    for r in requests:
        sl.submit(r)
    sl.step()  # prefills + first generate call
    steps0, t0 = sl.stats.generate_steps, time.perf_counter()
    while sl.num_requests:
        sl.step()
    return (time.perf_counter() - t0) / max(sl.stats.generate_steps - steps0, 1)


def frequent_token(graphdef, params, vocab: int) -> int:
    """The token the model predicts most often on random text (used as EOS to get
    long-tailed lengths from a random model)."""
    x = np.random.default_rng(1).integers(2, vocab, (8, 32))
    probs = jax.nn.softmax(transformer.apply(graphdef, params, x)[0], axis=-1)
    return int(np.argmax(np.asarray(probs.mean(axis=(0, 1)))[2:])) + 2


def sweep_decode_steps(name: str, slots: int, decode_len: int, per_slot: int, repeats: int):
    """All slots busy: slice/fixed-batch ratio for each tokens-per-call setting."""
    cfg = model_config(name)
    mesh = one_device_mesh()
    _, params = transformer.create(cfg.model, cfg.seed)
    reqs = make_requests(per_slot * slots, cfg.rollout.max_prefill_length, cfg.model.vocab_size)
    print(f"\n== {name} S={slots}: tokens per generate call (rollout.decode_steps), "
          f"all slots busy, {decode_len} tokens each")
    for n in _SWEEP.value:
        rollout = dataclasses.replace(cfg.rollout, slots_per_slice=slots,
                                      max_decode_len=decode_len, eos_id=-1,
                                      decode_steps=int(n), kv_cache="dense")
        sl = DecodeSlice(0, Engine(cfg.model, rollout, mesh))
        sl.load_version(0, params)
        fixed = make_fixed_batch(sl.engine)
        run_slice(sl, reqs[:slots])  # compile
        fixed(sl.params, reqs[:slots])
        (t_slice, _), (t_fixed, _) = best_of_interleaved(
            repeats, lambda: run_slice(sl, reqs), lambda: fixed(sl.params, reqs))
        print(f"   decode_steps {int(n):3d}: slice {len(reqs) * decode_len / t_slice:8.0f} "
              f"tokens/s, ratio {t_fixed / t_slice:.2f}")


def bench_model(name: str, slots: int, decode_len: int, per_slot: int, repeats: int) -> dict:
    """The model's figures: tokens/s of both samplers in both regimes, and seconds
    per decode step by busy slots (all slots busy, EOS disabled)."""
    cfg = model_config(name)
    mesh = one_device_mesh()
    graphdef, params = transformer.create(cfg.model, cfg.seed)
    S, max_prompt = slots, cfg.rollout.max_prefill_length
    print(f"\n== {name}: {transformer.count_params(params):,} params, S={S} slots, "
          f"max_decode_len={decode_len}, {per_slot * S} requests, prompts 4..{max_prompt} tokens")
    figures = dict(model=name, slots=S, decode_len=decode_len,
                   **model_shape(cfg.model, params), regimes={}, step_seconds={})
    eos_long_tail = frequent_token(graphdef, params, cfg.model.vocab_size)
    for label, eos in (("all slots busy (no EOS)", -1),
                       (f"long-tailed lengths (EOS={eos_long_tail})", eos_long_tail)):
        rollout = dataclasses.replace(cfg.rollout, slots_per_slice=S, max_decode_len=decode_len,
                                      eos_id=eos, kv_cache="dense")
        engine = Engine(cfg.model, rollout, mesh)
        sl = DecodeSlice(0, engine)
        sl.load_version(0, params)
        if eos < 0:  # what each KV layout's compiled step reads, against the ideal
            layouts = paged_engines(cfg.model, rollout, mesh)
            figures["step_bytes"] = {kv: step_bytes(e, e.load_params(params), kv)
                                     for kv, e in (("dense", engine), *layouts.items())}
        fixed = make_fixed_batch(engine)
        reqs = make_requests(per_slot * S, max_prompt, cfg.model.vocab_size)
        run_slice(sl, reqs[:S])  # compile
        fixed(sl.params, reqs[:S])
        (t_slice, out_slice), (t_fixed, out_fixed) = best_of_interleaved(
            repeats, lambda: run_slice(sl, reqs), lambda: fixed(sl.params, reqs))
        assert out_slice == out_fixed, "per-request RNG: both samplers must agree"
        lengths = [len(v) for v in out_slice.values()]
        tokens = sum(lengths)
        r = t_fixed / t_slice
        print(f"-- {label}, decode_steps={rollout.decode_steps}: {tokens} tokens, "
              f"lengths mean {statistics.mean(lengths):.1f} "
              f"median {statistics.median(lengths):.0f} max {max(lengths)}")
        print(f"   slice (continuous batching) {tokens / t_slice:8.0f} tokens/s   "
              f"fixed-batch while_loop {tokens / t_fixed:8.0f} tokens/s   ratio {r:.2f}   "
              f"slot utilisation {sl.stats.utilisation:.2f}")
        figures["regimes"]["all_busy" if eos < 0 else "long_tail"] = dict(
            tokens=tokens, slice_tokens_per_s=tokens / t_slice,
            fixed_tokens_per_s=tokens / t_fixed, ratio=r,
            slot_utilisation=sl.stats.utilisation)
        if eos < 0:
            print("   busy slots   ms per decode step   tokens/s")
            ks = range(1, S + 1) if S <= 8 else sorted({1, 2, 4, 8, S // 4, S // 2, S})
            for k in ks:
                dt = min(step_time(sl, reqs[:k]) for _ in range(repeats))
                figures["step_seconds"][str(k)] = dt
                print(f"   {k:10d} {dt * 1e3:20.3f} {k / dt:10.0f}")
            for kv, paged in layouts.items():
                paged_slice = DecodeSlice(0, paged)
                paged_slice.load_version(0, params)
                step_time(paged_slice, reqs[:S])  # compiles
                seconds = min(step_time(paged_slice, reqs[:S]) for _ in range(repeats))
                if kv == "paged":
                    figures["paged_step_seconds"] = {str(S): seconds}
                else:
                    figures.setdefault("paged_impl_step_seconds", {})[kv] = seconds
            figures["bound"] = decode_bound(figures, jax.devices()[0].device_kind)
    return figures


def paged_engines(model_cfg, rollout, mesh) -> dict:
    """The paged layouts measured: the config's paged attention ("paged"), then each
    other `--paged_attention` implementation ("paged/<impl>")."""
    def picked(impl: str) -> str:  # `auto` is pallas on TPU, elsewhere its own mix
        return "pallas" if paged_attention.resolve(impl) == "pallas" else impl

    impls = [rollout.paged_attention]
    for impl in _PAGED_IMPLS.value:  # each implementation once, `auto` as what it picks
        if picked(impl) not in map(picked, impls):
            impls.append(impl)
    return {("paged" if k == 0 else f"paged/{impl}"): Engine(model_cfg, dataclasses.replace(
        rollout, kv_cache="paged", paged_attention=impl), mesh) for k, impl in enumerate(impls)}


def step_bytes(engine: Engine, params, label: str = "") -> dict:
    """Bytes a compiled decode step accesses against the ideal, the weights read once
    plus the KV cache (`rollout.step_cost`), with every slot's pages mapped (paged)."""
    if engine.pages is not None:  # every slot at its whole length: the pool all read
        n = engine.cache_length
        for slot in range(engine.max_concurrent_decodes):
            engine.pages.assign_rows([slot], n, n)
    cost = step_cost(engine, params)
    if engine.pages is not None:
        engine.pages.reset()
    counted = cost["bytes_accessed"]
    cost["over_ideal"] = None if counted is None else counted / cost["ideal_bytes"]
    print(f"   decode step ({label or engine.rollout_cfg.kv_cache} KV): " + (
          "bytes not counted (a loop of unknown trip count)" if counted is None else
          f"{counted / 1e6:.3f} MB accessed, {cost['over_ideal']:.2f}x the ideal") +
          f"; ideal {cost['ideal_bytes'] / 1e6:.3f} MB (weights "
          f"{cost['weight_bytes'] / 1e6:.3f} + KV {cost['kv_bytes'] / 1e6:.3f}; XLA's cost "
          f"analysis: {cost['xla_bytes_accessed'] / cost['ideal_bytes']:.2f}x); "
          f"{cost['kernels'] or 'uncounted'} kernels (XLA thunks) per token")
    return cost


def print_step_bytes(models: list, slots: list, decode_len: int) -> None:
    """`--bytes_only`: what each KV layout's compiled decode step reads and writes."""
    mesh = one_device_mesh()
    for name in models:
        cfg = model_config(name)
        _, params = transformer.create(cfg.model, cfg.seed)
        for S in slots:
            print(f"\n== {name}, S={S} slots, max_decode_len={decode_len}, "
                  f"pages of {cfg.rollout.page_size}")
            rollout = dataclasses.replace(cfg.rollout, slots_per_slice=S,
                                          max_decode_len=decode_len, kv_cache="dense")
            engine = Engine(cfg.model, rollout, mesh)
            for kv, e in (("dense", engine), *paged_engines(cfg.model, rollout, mesh).items()):
                step_bytes(e, e.load_params(params), kv)


def profile_decode(name: str, S: int, decode_len: int, repeats: int) -> None:
    """Seconds per decode step with S busy slots (the config's KV cache and layer
    layout), then the kernels of one traced run of the same steps."""
    cfg = model_config(name)
    rollout = dataclasses.replace(cfg.rollout, slots_per_slice=S, max_decode_len=decode_len,
                                  eos_id=-1)
    mesh = one_device_mesh()
    _, params = transformer.create(cfg.model, cfg.seed)
    sl = DecodeSlice(0, Engine(cfg.model, rollout, mesh))
    sl.load_version(0, params)
    reqs = make_requests(2 * S, rollout.max_prefill_length, cfg.model.vocab_size)
    print(f"== {name}: {transformer.count_params(params):,} params, {cfg.model.dtype}, S={S}, "
          f"kv_cache={rollout.kv_cache}, scan_layers={cfg.model.scan_layers}, "
          f"decode_steps={rollout.decode_steps}")
    step_time(sl, reqs[:S])  # compiles
    seconds = min(step_time(sl, reqs[S:]) for _ in range(repeats))
    trace_dir = tempfile.mkdtemp(prefix="decode_profile_")
    steps0 = sl.stats.generate_steps
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        step_time(sl, reqs[:S])
    (path,) = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                        recursive=True)
    micros, launches = kernels.kernel_table(kernels.read_trace(path))
    print("\n".join(kernels.kernel_lines(micros, launches, sl.stats.generate_steps - steps0)))
    print(f"seconds per decode step: {seconds:.6f}")


def main(argv):
    del argv
    if _PROFILE.value:
        return profile_decode(_MODELS.value[0], max(int(x) for x in _SLOTS.value),
                              _DECODE_LEN.value, _REPEATS.value)
    print(f"device {jax.devices()[0].device_kind} ({jax.devices()[0].platform}), "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    slots = [int(x) for x in _SLOTS.value]
    if _BYTES_ONLY.value:
        return print_step_bytes(_MODELS.value, slots, _DECODE_LEN.value)
    if _SWEEP.value:
        sweep_decode_steps(_MODELS.value[0], max(slots), _DECODE_LEN.value, _PER_SLOT.value,
                           _REPEATS.value)
    device = jax.devices()[0]
    runs = {}
    for S in slots:  # the figures so far are kept after each run: a part stopped at its
        for m in _MODELS.value:  # budget (bench.accelerator) still reports them
            runs[(m, S)] = bench_model(m, S, _DECODE_LEN.value, _PER_SLOT.value,
                                       _REPEATS.value)
            write_figures(_JSON_OUT.value, dict(
                platform=device.platform, device_kind=device.device_kind,
                runs=list(runs.values()), ratio=None))
    ratios = {key: run["regimes"]["all_busy"]["ratio"] for key, run in runs.items()}
    print("\nall-slots-busy ratio (slice / fixed-batch tokens/s): " +
          ", ".join(f"{m} S={S}: {r:.2f}" for (m, S), r in ratios.items()))
    final = min(r for (m, S), r in ratios.items() if S == max(slots))
    print(f"slice/fixed-batch tokens/s ratio: {final:.2f}")
    write_figures(_JSON_OUT.value, dict(platform=device.platform, device_kind=device.device_kind,
                                        runs=list(runs.values()), ratio=final))


if __name__ == "__main__":
    app.run(main)
