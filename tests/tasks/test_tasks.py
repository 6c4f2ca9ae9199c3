"""The task registry: one name per task, each declaring to config the facts it
validates (config sits below the tasks and lists the shipped ones itself), and a
task added by registering one class, which validation then accepts and the run's
records, reward and demonstrations use."""

import pytest

from dora_jax import config, tasks
from dora_jax.data import prompts
from dora_jax.tasks import sources
from dora_jax.tasks.base import Task


def test_the_config_names_the_tasks_that_exist():
    assert set(config.SHIPPED_TASKS) <= set(tasks.names())
    assert set(config.TASKS) == set(tasks.names())


def test_each_task_states_what_the_config_checks_of_it():
    for name in tasks.names():
        task = tasks.get(name)
        assert task.name == name
        assert config.TASKS[name] == config.TaskFacts(task.reward, task.text, task.needs)


def test_a_shipped_task_declared_with_other_facts_is_refused():
    with pytest.raises(ValueError, match="task 'jsonl' declares"):
        config.declare_task("jsonl", config.TaskFacts("exact_match", needs="tfds_name"))
    assert config.TASKS["jsonl"] == config.TaskFacts("exact_match", needs="path")


def test_an_unknown_task_names_the_registered_ones():
    with pytest.raises(ValueError, match="unknown task 'nope'; registered: .*'residue'"):
        tasks.get("nope")


def test_a_task_is_registered_once():
    with pytest.raises(ValueError, match="registered twice"):
        @tasks.register
        class Another(Task):  # noqa: F841 - registering is the point
            name = "residue"
            reward = "residue"


def _echoed(record, response) -> float:
    return float(list(response[:1]) == record["tokens"][1:])


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
            return _echoed

        def demonstration_fn(self, cfg, tokenizer=None):
            return lambda record: [record["tokens"][1], 1]

    yield Echo
    tasks.unregister("echo")
    assert "echo" not in tasks.names()


def test_a_registered_task_is_what_the_run_builds(echo_task, load_config):
    cfg = load_config("configs/tiny.py:spread", data__num_prompts=5, data__source="echo")
    assert cfg.data.reward_name == "residue"  # the task's declared reward
    records, skipped = sources.prompt_records(cfg)
    assert [r["prompt_id"] for r in records] == [f"echo-{i}" for i in range(5)]
    assert skipped == []
    reward = sources.reward_for(cfg)
    demonstrate = sources.demonstration_for(cfg)
    assert [reward(r, demonstrate(r)) for r in records] == [1.0] * 5
    assert reward(records[0], [9, 1]) == 0.0
    assert demonstrate(records[2]) == [5, 1]


def test_a_task_unregistered_is_no_longer_a_valid_source(echo_task, load_config):
    tasks.unregister("echo")
    with pytest.raises(config.ConfigError, match=r"data\.source: must be one of .*'echo'"):
        load_config("configs/tiny.py:spread", data__source="echo")


def test_every_module_of_the_package_registers_its_tasks():
    """A task added as a file in dora_jax/tasks is found without being listed."""
    import pathlib

    names = tasks.names()
    files = {p.stem for p in pathlib.Path(tasks.__file__).parent.glob("*.py")}
    modules = {type(tasks.get(n)).__module__.rsplit(".", 1)[1] for n in names}
    assert modules == files - {"__init__", "base", "sources"}


def test_a_reward_the_pool_cannot_be_handed_fails_before_compute(echo_task, load_config,
                                                               monkeypatch):
    monkeypatch.setattr(echo_task, "reward_fn", lambda self, cfg, tokenizer=None:
                        lambda record, response: 1.0)
    cfg = load_config("configs/tiny.py:spread", data__num_prompts=5, data__source="echo")
    with pytest.raises(config.ConfigError, match=r"config\.data\.source: task 'echo': its "
                       r"reward function .* must pickle"):
        sources.reward_for(cfg)
