"""The task registry: one name per task, the same names and facts as the config's
lists (config sits below the tasks and cannot import them), and a task added by
registering one class that the run's records, reward and demonstrations then use."""

import dataclasses

import pytest

from dora_jax import config, tasks
from dora_jax.config.data import NEEDS
from dora_jax.data import prompts
from dora_jax.tasks import sources
from dora_jax.tasks.base import Task


def test_the_config_names_the_tasks_that_exist():
    assert sorted(config.DATA_SOURCES) == list(tasks.names())
    assert len(set(config.DATA_SOURCES)) == len(config.DATA_SOURCES)


def test_each_task_states_what_the_config_checks_of_it():
    for name in tasks.names():
        task = tasks.get(name)
        assert task.name == name
        assert config.AUTO_REWARDS[name] == task.reward, name
        assert (name in config.TEXT_SOURCES) == task.text, name
        assert NEEDS.get(name, "") == task.needs, name
    assert set(config.AUTO_REWARDS) == set(tasks.names())


def test_an_unknown_task_names_the_registered_ones():
    with pytest.raises(ValueError, match="unknown task 'nope'; registered: .*'residue'"):
        tasks.get("nope")


def test_a_task_is_registered_once():
    with pytest.raises(ValueError, match="registered twice"):
        @tasks.register
        class Another(Task):  # noqa: F841 - registering is the point
            name = "residue"
            reward = "residue"


@pytest.fixture
def echo_task():
    """A throwaway token task: prompts [BOS, 3 + i], its correct response that symbol
    then EOS, scored by whether the response starts with it."""

    @tasks.register
    class Echo(Task):
        name = "echo"
        reward = "residue"

        def records(self, cfg, tokenizer=None):
            return prompts.in_memory([{"prompt_id": f"echo-{i}", "tokens": [2, 3 + i]}
                                      for i in range(cfg.data.num_prompts)],
                                     cfg.model.vocab_size)

        def reward_fn(self, cfg, tokenizer=None):
            return lambda record, response: float(response[:1] == record["tokens"][1:])

        def demonstration_fn(self, cfg, tokenizer=None):
            return lambda record: [record["tokens"][1], 1]

    yield Echo
    tasks.unregister("echo")
    assert "echo" not in tasks.names()


def test_a_registered_task_is_what_the_run_builds(echo_task, load_config):
    cfg = _with_source(load_config("configs/tiny.py", data__num_prompts=5), "echo")
    records, skipped = sources.prompt_records(cfg)
    assert [r["prompt_id"] for r in records] == [f"echo-{i}" for i in range(5)]
    assert skipped == []
    reward = sources.reward_for(cfg)
    demonstrate = sources.demonstration_for(cfg)
    assert [reward(r, demonstrate(r)) for r in records] == [1.0] * 5
    assert reward(records[0], [9, 1]) == 0.0
    assert demonstrate(records[2]) == [5, 1]


def _with_source(cfg, source):
    """`cfg` with data.source set past validation: config's list of names holds only
    the built-in tasks (test_the_config_names_the_tasks_that_exist)."""
    data = dataclasses.replace(cfg.data)
    object.__setattr__(data, "source", source)
    object.__setattr__(data, "reward", "residue")
    return dataclasses.replace(cfg, data=data)
