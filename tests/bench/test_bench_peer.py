"""bench.peer's steady-state figures, worked by hand from a run's files."""

import json

import pytest

from dora_jax.bench import peer


def _write(tmp_path, steps, consumed):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step, time, tokens, train, wait in steps:
            f.write(json.dumps({"step": step, "time": time, "trained_tokens": tokens,
                                "step_time": train, "trainer_wait": wait}) + "\n")
        f.write(json.dumps({"eval": {"step": 4}, "time": 9.0}) + "\n")
    with open(tmp_path / "ledger.jsonl", "w") as f:
        for step, lengths in consumed:
            f.write(json.dumps({"event": "consume", "step": step, "samples": [
                {"response_len": n, "finish": "length" if n == 16 else "stop"}
                for n in lengths]}) + "\n")
        f.write(json.dumps({"event": "admit", "group_id": 9}) + "\n")
    (tmp_path / "summary.json").write_text(json.dumps({"mean_slot_utilisation": 0.75}))


def test_the_steady_state_is_what_follows_the_warmup_step(tmp_path):
    _write(tmp_path,
           steps=[(0, 5.0, 999, 0.9, 4.0), (1, 6.0, 100, 0.2, 0.1), (2, 6.5, 120, 0.3, 0.0),
                  (3, 7.5, 80, 0.1, 0.2)],
           consumed=[(0, [1, 1]), (1, [16, 4]), (2, [16, 8, 2]), (3, [6])])
    fig = peer.steady_figures(str(tmp_path), warmup=1)
    assert fig["tokens_per_s"] == pytest.approx((120 + 80) / (7.5 - 6.0))
    assert fig["step_s"] == pytest.approx(0.75)
    assert fig["train_s"] == pytest.approx(0.2) and fig["wait_s"] == pytest.approx(0.1)
    assert fig["slot_util"] == pytest.approx(0.75)
    assert fig["len_mean"] == pytest.approx(8.0) and fig["len_max"] == 16
    assert fig["len_p50"] == pytest.approx(7.0) and fig["cut_share"] == pytest.approx(0.25)


def test_too_few_steps_after_the_warmup_is_an_error(tmp_path):
    _write(tmp_path, steps=[(0, 1.0, 10, 0.1, 0.1), (1, 2.0, 10, 0.1, 0.1)],
           consumed=[(1, [3])])
    with pytest.raises(ValueError, match="too few"):
        peer.steady_figures(str(tmp_path), warmup=0)


def test_nostop_leaves_the_engine_without_stop_ids():
    from dora_jax.model import hf_checks
    from dora_jax.rollout import sampling

    held = hf_checks.validated(peer.workload_config("tiny", "dora", 6, stop=False))
    assert held.rollout.eos_id == -1 and sampling.stop_ids(held.rollout, None, None) == ()
    default = hf_checks.validated(peer.workload_config("tiny", "dora", 6))
    assert sampling.stop_ids(default.rollout, None, None) == (default.rollout.eos_id,)


def test_the_larger_workload_unrolls_its_full_forwards_and_tiny_scans():
    from dora_jax.model import hf_checks

    larger = hf_checks.validated(peer.workload_config("larger", "dora", 6, layout="pair"))
    m = larger.model
    assert (m.num_layers, m.d_model, m.mlp_hidden, m.unroll_forward) == (8, 256, 768, True)
    assert larger.rollout.max_decode_len == 128
    assert not hf_checks.validated(peer.workload_config("tiny", "dora", 6)).model.unroll_forward
