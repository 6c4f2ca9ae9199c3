"""Tiny dense policy: runs in seconds on a CPU.

Run: python -m dora_jax.main --config=configs/tiny.py --workdir=/tmp/dora_tiny

Model: 2 layers, d_model 64, 4 query / 2 KV heads of dim 16, SwiGLU 192, vocab 128,
untied embeddings: 115,072 parameters.

Mesh (8 devices; on a CPU set XLA_FLAGS=--xla_force_host_platform_device_count=8):
trainer data=2 x fsdp=2 on 4 devices, 4 decode slices of 1 device each.
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
    c.trainer.update(dict(length_buckets=(32,)))
    return c
