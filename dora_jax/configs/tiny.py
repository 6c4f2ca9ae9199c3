"""Tiny dense policy: runs in seconds on a CPU.

Run: python -m dora_jax.main --config=configs/tiny.py --workdir=/tmp/dora_tiny

Model: 2 layers, d_model 64, 4 query / 2 KV heads of dim 16, SwiGLU 192, vocab 128,
untied embeddings: 115,072 parameters.

Mesh (3 devices; on a CPU they are faked): the trainer on 1 device, 2 decode slices of
1 device each, 8 slots each. Faked devices share the host's cores, so a trainer split
over several of them adds collectives and no compute: on a 2-core host the spread
layout below trains at about half this one's tokens/s. The KV cache is dense: a slot
holds at most 24 positions, a page and a half, so pages would save no memory and cost
a page table per call (on a 2-core host the paged cache runs 6-15% fewer tokens/s).

Workload: the synthetic residue task (dora_jax/tasks/residue.py; 6-token prompts,
prefilled in one bucket of 8), groups of 4 samples, 4 groups per step, 8 groups
admitted ahead, max_staleness 2, 100 steps, a checkpoint every 25 steps but at most
one per 5 s (in 100 steps, the one at the end). Expect 7 to 12 s of compilation,
then 2 to 4 s for the 100 steps; the mean reward rises from about
0.25 (chance) towards 0.6-0.8 by the last steps. Try --config.coordinator.mode=sync.

Spread: the same policy and task on 8 devices, the trainer on data=2 x fsdp=2 and 4
decode slices (prompts bucketed at 8 and 16, the paged KV cache, a checkpoint every
5): a sharded trainer and more slices to place versions on; the multi-process examples
of docs/processes.md split it over processes.
Run: python -m dora_jax.main --config=configs/tiny.py:spread --workdir=/tmp/dora_spread
"""

from dora_jax import config as config_lib

VARIANTS = (None, "spread")


def get_config(arg=None):
    if arg not in VARIANTS:
        raise ValueError(f"configs/tiny.py: unknown variant {arg!r}; known: {VARIANTS}")
    c = config_lib.base()
    c.model.update(dict(vocab_size=128, d_model=64, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, mlp_hidden=192,
                        tie_embeddings=False, qk_norm=True))
    c.mesh.trainer.update(dict(data=1, fsdp=1, tensor=1, expert=1))
    c.mesh.slice.update(dict(tensor=1, expert=1))
    c.mesh.num_slices = 2
    c.rollout.update(dict(slots_per_slice=8, max_prefill_length=8, max_decode_len=16,
                          prefill_buckets=(8,)))
    c.trainer.update(dict(learning_rate=0.01, length_buckets=(24,)))
    # Residue task: the reward rises from about 0.25 (chance) within ~100 steps.
    c.coordinator.update(dict(mode="dora", group_size=4, train_batch_size=4,
                              rollout_batch_size=8, max_staleness=2, num_steps=100))
    c.data.update(dict(source="residue", reward="residue", num_prompts=512, prompt_len=6,
                       modulus=4))
    if arg == "spread":
        c.mesh.trainer.update(dict(data=2, fsdp=2))
        c.mesh.num_slices = 4
        c.rollout.update(dict(max_prefill_length=16, prefill_buckets=(8, 16)))
        c.trainer.length_buckets = (32,)
        return c
    # A save costs Orbax ~50 ms of CPU on a CPU host and the run ~0.1 s, five of this
    # config's steps (the cores are shared): saves every 25 steps took 13-18% of its
    # tokens/s (docs/checkpoints.md). At most one per 5 s keeps them near 2%: a
    # 100-step run saves at its end alone, and a kill redoes at most ~5 s of work
    # (nothing is lost either way). The spread layout saves every 5, as the base
    # config does.
    c.coordinator.update(dict(checkpoint_every=25, checkpoint_min_seconds=5.0))
    c.rollout.kv_cache = "dense"
    # The trainer's forward unrolled over its 2 layers (no stacked residuals): a median
    # 8% more tokens/s than scanned, 9 of 11 interleaved 300-step runs ahead, at the
    # same compile time (docs/benchmarks.md).
    c.model.unroll_forward = True
    return c
