"""What the trainer tests share: meshes, hand-made trajectories and batches, and a
countdown config small enough to train in seconds."""

import jax
import numpy as np
from jax.sharding import Mesh

from dora_jax import config as config_lib
from dora_jax.rl.batch import TrainBatch
from dora_jax.rollout import Trajectory

VOCAB = 128


def trainer_mesh(data=1, fsdp=1, tensor=1, expert=1):
    n = data * fsdp * tensor * expert
    devices = np.array(jax.devices()[:n]).reshape(data, fsdp, tensor, expert)
    return Mesh(devices, config_lib.TRAINER_MESH_AXES)


def make_trajectory(prompt_tokens, response_tokens, behaviour_logprobs, reward, group_id,
                    version):
    """A finished sample as the runtime hands it to the batch (rollout.Trajectory)."""
    return Trajectory(group_id=group_id, prompt_id=group_id, sample_index=0, version=version,
                      prompt_tokens=list(prompt_tokens), response_tokens=list(response_tokens),
                      behaviour_logprobs=list(behaviour_logprobs),
                      versions=[[version, len(response_tokens)]], slice_ids=[0],
                      finish_reason="eos", t_submit=0.0, t_start=0.0, t_finish=0.0,
                      reward=reward)


def trajectories(seed, num_groups, group_size, *, rewards=None, version=0, max_len=32,
                 behaviour=None):
    """Random trajectories; a group shares its prompt. Behaviour log-probs near the
    tiny model's initial ones (~log(1/VOCAB)) unless `behaviour` gives them per row."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(num_groups):
        prompt = rng.integers(2, VOCAB, rng.integers(2, 8)).tolist()
        for k in range(group_size):
            i = g * group_size + k
            n = int(rng.integers(1, max_len - len(prompt) + 1))
            logp = (np.log(1 / VOCAB) + 0.3 * rng.standard_normal(n)).clip(max=0)
            out.append(make_trajectory(
                prompt_tokens=prompt, response_tokens=rng.integers(2, VOCAB, n).tolist(),
                behaviour_logprobs=np.asarray(logp if behaviour is None else behaviour[i]).tolist(),
                reward=float(rewards[i] if rewards is not None else rng.random()),
                group_id=f"g{seed}-{g}", version=version))
    return out


def batch_of(trajs, group_size, buckets=(32,)):
    return TrainBatch.from_trajectories(trajs, group_size=group_size, length_buckets=buckets)


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def countdown_config(load_config, **rollout):
    c = load_config("configs/tiny.py:spread", validate=False)
    c.model.num_layers = 1
    c.rollout.update(dict(slots_per_slice=4, max_prefill_length=8, max_decode_len=16,
                          prefill_buckets=(8,)), **rollout)
    c.trainer.length_buckets = (24,)
    c.coordinator.update(dict(group_size=2, train_batch_size=2, rollout_batch_size=4,
                              num_steps=2))
    c.data.update(dict(source="countdown", reward="countdown", max_count=12, count_median=4.0,
                       num_prompts=64))
    return c
