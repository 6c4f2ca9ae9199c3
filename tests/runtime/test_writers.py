"""Metric writers: every record reaches each writer a config asks for; the W&B
writer, run against a fake `wandb` module (nothing reaches the network), logs the
TensorBoard tags at each record's step and continues its run on resume; a config
asking for W&B without the package fails naming the field."""

import json
import sys
import types

import pytest

from dora_jax import config as config_lib
from dora_jax.config.report import LoggingConfig
from dora_jax.config.schema import ConfigError
from dora_jax.runtime import writers
from dora_jax.runtime.report import StepReporter


class FakeRun:
    def __init__(self, **init):
        self.init, self.logged, self.finished, self.axes = init, [], False, {}

    def define_metric(self, name, step_metric):
        self.axes[name] = step_metric

    def log(self, data, step=None):
        self.logged.append((step, dict(data)))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    runs = []

    def init(**kwargs):
        runs.append(FakeRun(**kwargs))
        return runs[-1]

    ids = iter(["run-a", "run-b"])
    module = types.SimpleNamespace(init=init, runs=runs,
                                   util=types.SimpleNamespace(generate_id=lambda: next(ids)))
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


RECORDS = [{"step": 0, "reward_mean": 0.5, "trainer": {"loss": 1.5}, "resident_versions": [0]},
           {"step": 1, "reward_mean": 0.75, "trainer": {"loss": 1.25}, "resident_versions": [0, 1]}]
EVAL = {"step": 1, "eval": {"version": 1, "pass_at_1": 0.25}}  # scored after step 1's


def _write(reporter, records):
    for r in records:
        reporter._writer.put(r)
    reporter.close()


def test_every_writer_gets_every_record(tmp_path, fake_wandb):
    cfg = LoggingConfig(tensorboard=True, wandb_project="proj", wandb_mode="offline")
    _write(StepReporter(writers=writers.make_writers(cfg, str(tmp_path), run_config={"seed": 3})),
           RECORDS + [EVAL])
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == RECORDS + [EVAL]
    from dora_jax.runtime.tensorboard import read_scalars

    board = read_scalars(str(tmp_path / "tensorboard"))
    assert board["trainer/loss"] == [(0, 1.5), (1, 1.25)]
    assert board["eval/pass_at_1"] == [(1, 0.25)]
    (run,) = fake_wandb.runs
    assert run.init["project"] == "proj" and run.init["mode"] == "offline"
    assert run.init["id"] == "run-a" and run.init["resume"] == "allow"
    assert run.init["name"] == tmp_path.name and run.init["config"] == {"seed": 3}
    assert run.logged == [(0, {"reward_mean": 0.5, "trainer/loss": 1.5,
                               "resident_versions/count": 1.0}),
                          (1, {"reward_mean": 0.75, "trainer/loss": 1.25,
                               "resident_versions/count": 2.0}),
                          # At W&B's current step, charted against its version.
                          (None, {"eval/version": 1.0, "eval/pass_at_1": 0.25})]
    assert run.axes == {"eval/*": "eval/version"}
    assert run.finished
    # A resumed run continues the same W&B run.
    writers.WandbWriter(cfg, str(tmp_path)).close()
    assert fake_wandb.runs[1].init["id"] == "run-a"


def test_defaults_write_jsonl_and_tensorboard_only(tmp_path, fake_wandb):
    made = writers.make_writers(config_lib.LoggingConfig(), str(tmp_path))
    assert [type(w).__name__ for w in made] == ["JsonlWriter", "TensorBoardWriter"]
    for w in made:
        w.close()
    made = writers.make_writers(LoggingConfig(tensorboard=False), str(tmp_path))
    assert [type(w).__name__ for w in made] == ["JsonlWriter"]
    made[0].close()
    assert not fake_wandb.runs


def test_wandb_configured_but_not_installed_names_the_field(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails as if absent
    with pytest.raises(ConfigError, match="config.logging.wandb_project: .*not installed"):
        writers.make_writers(LoggingConfig(wandb_project="proj"), str(tmp_path))


def test_logging_fields_are_validated(load_config):
    with pytest.raises(ConfigError, match="config.logging.wandb_mode: must be one of"):
        load_config("configs/tiny.py:spread", num_devices=8, logging__wandb_mode="cloud")


def test_a_failing_writer_still_lets_the_others_close(tmp_path):
    closed = []

    class Broken:
        def write(self, record):
            raise OSError("disk full")

        def close(self):
            closed.append("broken")

    class Fine:
        def write(self, record):
            pass

        def close(self):
            closed.append("fine")

    reporter = StepReporter(writers=[Fine(), Broken()])
    reporter._writer.put(RECORDS[0])
    with pytest.raises(OSError, match="disk full"):
        reporter.close()
    assert sorted(closed) == ["broken", "fine"]


def test_tensorboards_own_reader_sees_each_step_and_a_resumes_purge(tmp_path):
    """The event files as TensorBoard itself reads them (its EventAccumulator, which drops
    what a later file's session start purges): every step's scalars, a resumed run's
    steps replacing those the crashed run had written past its checkpoint."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from dora_jax.runtime.tensorboard import TensorBoardWriter

    logdir = str(tmp_path / "tensorboard")
    crashed = TensorBoardWriter(logdir)
    for step in range(4):
        crashed.write({"step": step, "reward_mean": step / 10, "trainer": {"loss": 1.0 - step / 8}})
    crashed.close()
    resumed = TensorBoardWriter(logdir, purge_step=2)  # resumed from step 2's checkpoint
    for step in range(2, 5):
        resumed.write({"step": step, "reward_mean": 0.5 + step, "trainer": {"loss": -step}})
    resumed.close()
    board = accumulator.EventAccumulator(logdir)
    board.Reload()
    assert sorted(board.Tags()["scalars"]) == ["reward_mean", "trainer/loss"]
    assert [(e.step, e.value) for e in board.Scalars("reward_mean")] == [
        (0, 0.0), (1, pytest.approx(0.1)), (2, 2.5), (3, 3.5), (4, 4.5)]
    assert [(e.step, e.value) for e in board.Scalars("trainer/loss")] == [
        (0, 1.0), (1, 0.875), (2, -2.0), (3, -3.0), (4, -4.0)]


def test_event_records_carry_the_tfrecord_checksum():
    """CRC-32C's published check value, then the masked CRCs TensorBoard verifies."""
    from dora_jax.runtime import tensorboard

    assert tensorboard.crc32c(b"123456789") == 0xE3069283
    assert tensorboard.crc32c(b"") == 0


def test_we_read_tensorboards_own_event_files(tmp_path):
    """Files written by TensorBoard's writer and protocol buffers (not ours): scalars,
    a negative step, and a later file's session start purging the steps after it."""
    pytest.importorskip("tensorboard")
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    from dora_jax.runtime.tensorboard import read_scalars

    def scalar(step, **tags):
        return event_pb2.Event(step=step, wall_time=1.0, summary=summary_pb2.Summary(value=[
            summary_pb2.Summary.Value(tag=t, simple_value=v) for t, v in tags.items()]))

    first = EventFileWriter(str(tmp_path), filename_suffix=".a")
    for step in (-1, 0, 1, 2):
        first.add_event(scalar(step, loss=step / 4, **{"eval/pass": 0.5}))
    first.close()
    second = EventFileWriter(str(tmp_path), filename_suffix=".b")
    second.add_event(event_pb2.Event(step=1, session_log=event_pb2.SessionLog(
        status=event_pb2.SessionLog.START)))
    second.add_event(scalar(1, loss=7.0))
    second.close()
    assert read_scalars(str(tmp_path)) == {"loss": [(-1, -0.25), (0, 0.0), (1, 7.0)],
                                          "eval/pass": [(-1, 0.5), (0, 0.5)]}


def test_an_unfinished_last_record_waits_and_a_corrupt_one_is_refused(tmp_path):
    from dora_jax.runtime.tensorboard import TensorBoardWriter, read_scalars

    writer = TensorBoardWriter(str(tmp_path))
    for step in range(3):
        writer.write({"step": step, "loss": float(step), "huge": 1e39})
    writer.close()
    (path,) = tmp_path.glob("events.out.tfevents.*")
    whole = path.read_bytes()
    assert read_scalars(str(tmp_path))["huge"] == [(s, float("inf")) for s in range(3)]
    path.write_bytes(whole[:-5])  # a kill mid-record: the last step is not there yet
    assert read_scalars(str(tmp_path))["loss"] == [(0, 0.0), (1, 1.0)]
    corrupt = bytearray(whole)
    corrupt[-10] ^= 0x01  # a bit of the last step's payload
    path.write_bytes(bytes(corrupt))
    with pytest.raises(ValueError, match="corrupt record"):
        read_scalars(str(tmp_path))


def test_writing_events_imports_no_framework(tmp_path):
    """The events are written without tensorboardX (which imports torch where it is
    installed) or TensorFlow."""
    import subprocess

    code = ("import sys; from dora_jax.runtime.tensorboard import TensorBoardWriter\n"
            f"w = TensorBoardWriter({str(tmp_path)!r}); w.write({{'step': 0, 'x': 1.0}})\n"
            "w.close(); print(sorted(m for m in ('torch', 'tensorboardX', 'tensorflow',"
            " 'google.protobuf') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"
