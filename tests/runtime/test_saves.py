"""The periodic saves' cadence (runtime/saves.py), worked by hand."""

from dora_jax.runtime.saves import SaveCadence


def test_a_save_is_due_every_n_steps_unless_the_last_began_too_recently():
    # Every 2 steps, at most one per 5 s; the run starts at t = 10 s and a step takes
    # 1 s: steps 2 and 4 come too soon after the start, step 6 (t = 16) is due; then
    # 8 and 10 come too soon after it, 12 (t = 22, 6 s after it) is due.
    cadence = SaveCadence(every=2, min_seconds=5.0, now=10.0)
    due = []
    for steps_done in range(1, 15):
        now = 10.0 + steps_done
        if cadence.due(steps_done, now):
            due.append(steps_done)
            cadence.saved(now)
    assert due == [6, 12]


def test_no_minimum_keeps_the_step_cadence_and_every_zero_saves_nothing():
    cadence = SaveCadence(every=3, min_seconds=0.0, now=0.0)
    assert [s for s in range(1, 10) if cadence.due(s, 0.0)] == [3, 6, 9]
    never = SaveCadence(every=0, min_seconds=0.0, now=0.0)
    assert not any(never.due(s, 100.0 * s) for s in range(1, 10))


def test_a_save_out_of_cadence_restarts_the_interval():
    # A save taken for another reason (the run's end, before a resume) counts too.
    cadence = SaveCadence(every=1, min_seconds=5.0, now=0.0)
    assert cadence.due(1, 6.0)
    cadence.saved(7.0)
    assert not cadence.due(2, 11.0) and cadence.due(3, 12.0)
