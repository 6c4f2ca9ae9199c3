"""Tiny dense policy: runs in seconds on a CPU.

Run: python -m dora_jax.main --config=configs/tiny.py --workdir=/tmp/dora_tiny

Model: 2 layers, d_model 64, 4 query / 2 KV heads of dim 16, SwiGLU 192, vocab 128,
untied embeddings: 115,072 parameters.

Mesh (8 devices; on a CPU set XLA_FLAGS=--xla_force_host_platform_device_count=8):
trainer data=2 x fsdp=2 on 4 devices, 4 decode slices of 1 device each, 8 slots each.

Workload: the synthetic residue task (dora_jax/tasks/residue.py), groups of 4 samples,
4 groups per step, 8 groups admitted ahead, max_staleness 2, 100 steps. Expect about a
minute of compilation, then ~0.2 s per step; the mean reward rises from about 0.25
(chance) towards 0.6-0.8 by the last steps. Try --config.coordinator.mode=sync.
"""

from dora_jax import config as config_lib

VARIANTS = (None,)


def get_config(arg=None):
    del arg
    c = config_lib.base()
    c.model.update(dict(vocab_size=128, d_model=64, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, mlp_hidden=192,
                        tie_embeddings=False, qk_norm=True))
    c.mesh.trainer.update(dict(data=2, fsdp=2, tensor=1, expert=1))
    c.mesh.slice.update(dict(tensor=1, expert=1))
    c.mesh.num_slices = 4
    c.rollout.update(dict(slots_per_slice=8, max_prefill_length=16, max_decode_len=16,
                          prefill_buckets=(8, 16)))
    c.trainer.update(dict(learning_rate=0.01, length_buckets=(32,)))
    # Residue task: the reward rises from about 0.25 (chance) within ~100 steps.
    c.coordinator.update(dict(mode="dora", group_size=4, train_batch_size=4,
                              rollout_batch_size=8, max_staleness=2, num_steps=100))
    c.data.update(dict(source="residue", reward="residue", num_prompts=512, prompt_len=6,
                       modulus=4))
    return c
