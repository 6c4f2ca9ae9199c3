"""The warm-up's compile times (runtime/compile_times.py): the line before compiling
says what the last run in the workdir measured, or that nothing was."""

import json

from dora_jax.runtime import compile_times


def test_first_run_says_the_timing_is_unknown(tmp_path):
    line = compile_times.announcement(["train step", "generate"], str(tmp_path))
    assert line == "compiling: train step, generate (first run: timing unknown)"


def test_the_next_run_states_the_last_measurement(tmp_path):
    watch = compile_times.Stopwatch()
    watch.seconds = {"train step": 12.25, "generate": 30.5}  # as if measured
    watch.save(str(tmp_path))
    assert json.loads((tmp_path / compile_times.FILE).read_text()) == watch.seconds
    assert watch.summary() == "compiled in 43 s: train step 12.2 s, generate 30.5 s"
    line = compile_times.announcement(["train step", "generate"], str(tmp_path))
    assert line == ("compiling: train step, generate (about 43 s on this host, as the "
                    "last run here took)")


def test_a_damaged_record_counts_as_no_measurement(tmp_path):
    (tmp_path / compile_times.FILE).write_text('{"train step": "soon"}')
    assert compile_times.previous(str(tmp_path)) is None
    (tmp_path / compile_times.FILE).write_text("not json")
    assert "timing unknown" in compile_times.announcement(["x"], str(tmp_path))


def test_the_stopwatch_adds_up_a_phase_timed_twice():
    watch = compile_times.Stopwatch()
    for _ in range(2):
        with watch("generate"):
            pass
    assert list(watch.seconds) == ["generate"] and watch.seconds["generate"] >= 0
