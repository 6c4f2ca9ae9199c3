"""Run state that survives a crash or a bad disk: the ledger's cut-off last line is
repaired (and the resume says so), a bad line elsewhere is named; workdir files are
replaced whole; a damaged newest checkpoint gives way to an older one; a full disk at
the end still lets the pending checkpoint save finish; and a run cut mid-line twice
resumes twice and audits clean."""

import errno
import gc
import glob
import json
import os

import pytest
from test_resume import _admit, _consume  # the same hand-made events

from dora_jax.base import atomic_files
from dora_jax.config import ConfigError
from dora_jax.runtime import recovery
from dora_jax.scheduler import ledger


def _write(path, events, cut_last: int | None = None):
    """Writes `events` as a ledger; `cut_last` keeps only that many bytes of the last
    line (no newline), as a kill mid-write leaves it."""
    lines = [json.dumps(e) + "\n" for e in events]
    if cut_last is not None:
        lines[-1] = lines[-1][:cut_last]
    path.write_text("".join(lines))


# ------------------------------------------------------------------ the ledger file
def test_writer_repairs_a_cut_last_line_and_says_what_it_dropped(tmp_path):
    path = tmp_path / "ledger.jsonl"
    _write(path, [_admit(0, 0), _admit(1, 0)], cut_last=17)
    assert len(ledger.read(str(path))) == 1  # the cut line is left out, not an error
    writer = ledger.LedgerWriter(str(path))
    assert writer.repaired == {"dropped_bytes": 17}
    writer.write("resume", step=0, repaired=writer.repaired)
    writer.close()
    events = ledger.read(str(path))  # the old writer left '{"event": "admit"{"event"...'
    assert [e["event"] for e in events] == ["admit", "resume"]
    assert events[1]["repaired"] == {"dropped_bytes": 17}
    assert path.read_bytes().endswith(b"\n")
    # A clean ledger, a missing one, and one that is all a cut line.
    assert ledger.LedgerWriter(str(path)).repaired is None
    assert ledger.LedgerWriter(str(tmp_path / "new.jsonl")).repaired is None
    (tmp_path / "cut.jsonl").write_text('{"event": "adm')
    assert ledger.LedgerWriter(str(tmp_path / "cut.jsonl")).repaired == {"dropped_bytes": 14}
    assert (tmp_path / "cut.jsonl").read_bytes() == b""


def test_a_last_line_without_its_newline_is_cut_even_if_it_parses(tmp_path):
    # The newline is written with the line: without it the write did not complete,
    # and reader and writer agree to drop it (a resume plans from what stays).
    path = tmp_path / "ledger.jsonl"
    _write(path, [_admit(0, 0), _admit(1, 0)])
    path.write_bytes(path.read_bytes()[:-1])
    assert [e["group_id"] for e in ledger.read(str(path))] == [0]
    assert ledger.LedgerWriter(str(path)).repaired["dropped_bytes"] > 0
    assert [e["group_id"] for e in ledger.read(str(path))] == [0]


@pytest.mark.parametrize("bad, says", [
    (b'{"event": "admit", "gr{"event": "resume"}', "not JSON (Expecting ':' delimiter)"),
    (b'{"event": "admit", "group', "not JSON (Unterminated string starting at)"),
    (b'[1, 2]', 'not a ledger event (no "event" name)'),
    (b'{"group_id": 1}', 'not a ledger event (no "event" name)'),
    (b'\xff\xfe{}', "not UTF-8 text"),
])
def test_a_bad_line_before_the_last_is_an_error_naming_file_and_line(tmp_path, bad, says):
    path = tmp_path / "ledger.jsonl"
    _write(path, [_admit(0, 0), _admit(1, 0), _admit(2, 0)])
    lines = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join(lines[:1] + [b"", bad] + lines[1:]))  # line 3; line 2 blank
    with pytest.raises(ledger.LedgerError) as e:
        ledger.read(str(path))
    assert str(e.value) == f"{path}:3: {says}"
    # Resuming there stops with that line (main prints it after "error: ").
    with pytest.raises(ConfigError, match=f"^{path}:3: "):
        recovery.load(str(tmp_path), None, None, None, [])


def test_a_cut_consume_is_a_group_not_consumed_and_the_resume_redoes_it(tmp_path):
    """A kill while writing step 1's consume lines: the checkpoint is of version 1
    (it is saved only after a step's consume lines), the cut line is dropped, and the
    resumed run regenerates that group and trains step 1 again; the whole ledger
    audits clean, and would not if the cut line counted."""
    path = tmp_path / "ledger.jsonl"
    before = [_admit(0, 0), _admit(1, 0), _admit(2, 0), _consume(0, 0, 0), _admit(3, 1),
              _consume(1, 0, 1), _consume(2, 0, 1)]
    _write(path, before, cut_last=40)
    events = ledger.read(str(path))
    p = recovery.plan(events, 1, {}, checkpoint_next_group_id=3)
    # Group 2's consume never completed and group 1's is void (step 1 >= the resume).
    assert p.readmit == (1, 2, 3) and p.next_group_id == 4
    writer = ledger.LedgerWriter(str(path))
    writer.write("resume", step=1, repaired=writer.repaired)
    for e in [_admit(1, 1, readmit=True), _admit(2, 1, readmit=True), _consume(1, 1, 1),
              _admit(3, 2, readmit=True), _consume(2, 1, 2), _consume(3, 2, 3)]:
        writer.write(e.pop("event"), **e)
    writer.close()
    report = ledger.audit(ledger.read(str(path)), train_batch_size=1, group_size=1,
                          max_staleness=1)
    assert report.ok and report.steps == 4, report.summary() + str(report.c2)


def test_a_cut_admit_never_happened_and_its_id_and_prompt_are_given_again(tmp_path):
    # The checkpoint (version 1) was taken with groups 0-1 admitted; group 2's admit
    # was cut. The ledger knows no group 2: the resumed run admits a new group 2 and
    # the prompt stream gives its prompt again (nothing admitted since the checkpoint).
    path = tmp_path / "ledger.jsonl"
    _write(path, [_admit(0, 0), _admit(1, 0), _consume(0, 0, 0), _admit(2, 1)], cut_last=30)
    p = recovery.plan(ledger.read(str(path)), 1, {}, checkpoint_next_group_id=2)
    assert (p.readmit, p.next_group_id, p.admitted_since_checkpoint) == ((1,), 2, 0)


# ------------------------------------------------------------------ workdir files
def test_write_atomic_leaves_the_old_file_when_the_disk_is_full(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    atomic_files.write_json_atomic(str(path), {"a": 1})
    assert atomic_files.read_json_object(str(path)) == {"a": 1}

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        atomic_files.write_json_atomic(str(path), {"a": 2})
    assert atomic_files.read_json_object(str(path)) == {"a": 1}
    assert os.listdir(tmp_path) == ["config.json"]  # no temporary file left


@pytest.mark.parametrize("content, says", [
    ("", "empty"), ("  \n", "empty"), ('{"model": ', "not JSON (Expecting value)"),
    ("[1]", "not a JSON object (a list)")])
def test_a_damaged_config_json_is_one_line_naming_it(tmp_path, small_config, content, says):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ConfigError) as e:
        recovery.prepare(str(tmp_path), small_config("dora"), fresh=False)
    message = str(e.value)
    assert message.startswith(f"{tmp_path / 'config.json'}: {says}; ") and "--fresh" in message
    assert "\n" not in message
    recovery.prepare(str(tmp_path), small_config("dora"), fresh=True)  # --fresh goes on


def test_truncate_metrics_rewrites_whole_and_drops_a_cut_line(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "x": s}) + "\n" for s in range(4)]
    path.write_text("".join(lines) + '{"step": 4, "x"')
    real_replace = os.replace

    def fails(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", fails)
    with pytest.raises(OSError):
        recovery.truncate_metrics(str(tmp_path), 2)
    assert path.read_text().startswith("".join(lines))  # untouched by the failed rewrite
    monkeypatch.setattr(os, "replace", real_replace)
    recovery.truncate_metrics(str(tmp_path), 3)
    assert path.read_text() == "".join(lines[:3])
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]


# ------------------------------------------------------------------ end to end
class _Trainer:
    """Builds a Trainer subclass that raises at step `fail_at` (None: never)."""

    def __init__(self, fail_at=None):
        self.fail_at, self.made = fail_at, []

    def __call__(self, *args, **kwargs):
        from dora_jax.rl.trainer import Trainer

        fail_at = self.fail_at

        class Failing(Trainer):
            def train_step(self, batch):
                if self.version == fail_at:
                    raise FloatingPointError(f"injected failure in step {self.version}")
                return super().train_step(batch)

        self.made.append(Failing(*args, **kwargs))
        return self.made[-1]


def _cut_mid_line(path, event=None) -> int:
    """Simulates a kill mid-write: drops the lines after the last one of `event` (any
    event if None) and half of that line. Returns the bytes left of it."""
    lines = open(path, "rb").read().splitlines(keepends=True)
    i = max(k for k, line in enumerate(lines)
            if event is None or json.loads(line)["event"] == event)
    keep = len(lines[i]) // 2
    with open(path, "wb") as f:
        f.writelines(lines[:i])
        f.write(lines[i][:keep])
    return keep


# A restore that fails drops the reads of its other arrays unawaited; collected here,
# not in whichever test runs next.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.slow
def test_a_run_cut_mid_line_twice_resumes_twice_and_audits_clean(tmp_path, small_config):
    """Run 1 dies at step 3 (checkpoint at version 2) while writing step 2's consume
    lines; run 2 resumes, dies at step 5 (checkpoint at version 4) mid-way through its
    last line, and its newest checkpoint is damaged on disk besides (a data file cut
    short), with a save's temporary directory left behind; run 3 repairs the ledger,
    restores version 2 instead, and finishes. The ledger audits clean and its resume
    lines say what was repaired and skipped."""
    from conftest import audit_workdir

    from dora_jax.runtime import experiment
    from dora_jax.runtime.loop import RunError

    cfg = small_config("dora", num_steps=6, checkpoint_every=2)
    ledger_path, ckpts = tmp_path / "ledger.jsonl", tmp_path / "checkpoints"
    with pytest.raises(RunError, match="step 3"):
        experiment.run(cfg, str(tmp_path), make_trainer=_Trainer(fail_at=3))
    _cut_mid_line(ledger_path, "consume")
    with pytest.raises(RunError, match="step 5"):
        experiment.run(cfg, str(tmp_path), make_trainer=_Trainer(fail_at=5))
    cut = _cut_mid_line(ledger_path)
    data = max(glob.glob(str(ckpts / "4" / "state" / "**" / "d" / "*"), recursive=True),
               key=os.path.getsize)
    os.truncate(data, os.path.getsize(data) // 3)
    (ckpts / "6.orbax-checkpoint-tmp").mkdir()
    (ckpts / "6.orbax-checkpoint-tmp" / "_CHECKPOINT_METADATA").write_text("{")

    trainer = _Trainer()
    summary = experiment.run(cfg, str(tmp_path), make_trainer=trainer)
    assert summary["resumed_from_step"] == 2 and trainer.made[0].version == 6
    events, report = audit_workdir(cfg, tmp_path)
    assert report.ok and report.steps == 6, report.summary() + str(report.c2[:3])
    resumes = [e for e in events if e["event"] == "resume"]
    assert [r["step"] for r in resumes] == [2, 2]
    assert all(r["repaired"]["dropped_bytes"] > 0 for r in resumes)
    assert resumes[1]["repaired"] == {"dropped_bytes": cut}
    [skipped] = resumes[1]["skipped_checkpoints"]
    assert skipped["step"] == 4 and skipped["moved_to"] == str(ckpts / "4.damaged")
    assert "skipped_checkpoints" not in resumes[0]
    assert sorted(os.listdir(ckpts)) == ["2", "4", "4.damaged", "6"]  # no tmp left
    metrics = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(6))
    gc.collect()


def test_a_full_disk_at_the_end_still_finishes_the_pending_save(tmp_path, small_config,
                                                                 monkeypatch):
    """The ledger's final lines fail (no space), and so does its close, as a full disk
    does; the slices and the trainer still stop and the checkpointer still closes,
    so the save of the last step, still pending, reaches the disk."""
    from dora_jax.model import checkpointing
    from dora_jax.runtime import experiment, loop

    class FullDisk(ledger.LedgerWriter):
        def write(self, event, **fields):
            if event == "unconsumed":
                raise OSError(errno.ENOSPC, "No space left on device")
            super().write(event, **fields)

        def close(self):
            super().close()
            raise OSError(errno.ENOSPC, "No space left on device")

    closed, runtimes = [], []
    real_close = checkpointing.Checkpointer.close

    def close(self):
        real_close(self)
        if self.directory.startswith(str(tmp_path)):  # not the warm-up's scratch save
            closed.append(sorted(os.listdir(self.directory)))

    class Recorded(loop.Runtime):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            runtimes.append(self)

    monkeypatch.setattr(checkpointing.Checkpointer, "close", close)
    monkeypatch.setattr(experiment, "LedgerWriter", FullDisk)
    monkeypatch.setattr(experiment, "Runtime", Recorded)
    cfg = small_config("dora", num_steps=2, checkpoint_every=1)
    with pytest.raises(OSError, match="No space"):
        experiment.run(cfg, str(tmp_path))
    assert closed == [["1", "2"]]  # closed once, with step 2 saved whole (no tmp)
    [rt] = runtimes
    assert rt.book.groups  # groups were in flight: the unconsumed lines were due
    assert not rt.trainer_worker.is_alive()
    assert not any(w._thread.is_alive() for w in rt.workers)


def test_checkpoints_go_to_the_checkpoint_dir_and_the_run_resumes_from_there(
        tmp_path, small_config):
    """`coordinator.checkpoint_dir` (the launcher points it at the bucket's gs://
    URL) holds the checkpoints instead of <workdir>/checkpoints; the same command
    then finds them: a finished run is not trained again."""
    from dora_jax.runtime import experiment

    elsewhere = tmp_path / "bucket" / "checkpoints"
    cfg = small_config("dora", num_steps=2, checkpoint_every=1, checkpoint_dir=str(elsewhere))
    experiment.run(cfg, str(tmp_path / "run"))
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert "2" in os.listdir(elsewhere)
    assert experiment.run(cfg, str(tmp_path / "run"))["already_trained"] == 2


def test_a_field_added_since_the_run_reads_as_its_default(tmp_path, small_config):
    """A workdir written before a config field existed resumes under its default;
    another value of it, or a changed old field, is still refused by name."""
    import json

    from dora_jax.config import ConfigError

    cfg = small_config("dora")
    recovery.prepare(str(tmp_path), cfg, fresh=False)
    path = tmp_path / "config.json"
    written = json.loads(path.read_text())
    del written["trainer"]["tokens_per_microbatch"]  # as a run written before it existed
    path.write_text(json.dumps(written))
    recovery.prepare(str(tmp_path), cfg, fresh=False)  # the default: the same run
    path.write_text(json.dumps(written))
    c = small_config("dora", validate=False)
    c.trainer.tokens_per_microbatch = 64 * 4
    from dora_jax.model import hf_checks
    with pytest.raises(ConfigError, match="trainer.tokens_per_microbatch: None -> 256"):
        recovery.prepare(str(tmp_path), hf_checks.validated(c, num_devices=8), fresh=False)
