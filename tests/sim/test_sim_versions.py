"""The simulator with several versions per slice and with LoRA: the cost of a decode
step by distinct versions, LoRA's shape arithmetic against model/lora.py, the memory
check of V full-weight copies, and dora on the LoRA preset with K + 1 versions per
slice (audited clean, no slot idle for want of its version)."""

import dataclasses

import pytest
from test_sim import ZERO

from dora_jax.sim import PRESETS
from dora_jax.sim.cost import CostModel, lora_adapter_params
from dora_jax.sim.presets import H800, QWEN25_32B, QWEN25_32B_SHAPE
from dora_jax.sim.run import scheduler_config, simulate


def test_each_extra_distinct_version_adds_its_read_to_a_step():
    cost = dataclasses.replace(ZERO, step_fixed=1.0, step_per_seq=0.5, per_version_read=0.25)
    assert cost.step_seconds(4, 0) == 3.0
    assert cost.step_seconds(4, 0, versions=3) == 3.5
    assert cost.steps_seconds(2, 4, 0, versions=2) == 2 * 3.25


def test_lora_costs_from_hardware():
    """LoRA: a publish moves the adapters; a step reads the base and one adapter
    set, each extra version its adapters; with full weights an extra version reads
    all the weights again, and V copies take their bytes from the KV memory."""
    preset = PRESETS["paper128_lora"]
    lora, full = preset.cost(versions=1), PRESETS["paper128"].cost()
    adapters = preset.adapter_params * preset.adapter_param_bytes
    assert lora.weight_bytes == adapters and full.weight_bytes == QWEN25_32B["params"] * 2
    assert lora.per_version_read == pytest.approx(full.per_version_read * adapters
                                                  / full.weight_bytes)
    assert lora.step_fixed - full.step_fixed == pytest.approx(lora.per_version_read)
    assert lora.train_per_token < full.train_per_token  # no base weight gradients
    full4 = PRESETS["paper128"].cost(versions=4)
    assert full4.kv_tokens == pytest.approx(
        full.kv_tokens - 3 * full.weight_bytes / QWEN25_32B["kv_bytes_per_token"], abs=1)
    assert preset.cost(versions=4).kv_tokens > full4.kv_tokens


def test_versions_that_do_not_fit_are_refused_naming_the_field():
    small = dataclasses.replace(PRESETS["paper128"], hardware=dict(H800, hbm_bytes=20e9))
    small.cost(versions=1)
    with pytest.raises(ValueError, match="rollout.versions_per_slice"):
        small.cost(versions=4)
    with pytest.raises(ValueError, match="rollout.versions_per_slice"):
        CostModel.from_hardware(**QWEN25_32B, slice_devices=1, trainer_devices=1, **H800,
                                efficiency=PRESETS["paper128"].efficiency, versions=2)


def test_lora_shape_arithmetic_matches_the_models_adapters():
    transformer = pytest.importorskip("dora_jax.model.transformer")
    from dora_jax.config.model import LoRAConfig, ModelConfig

    cfg = ModelConfig(vocab_size=32, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1,
                      head_dim=8, mlp_hidden=24, lora=LoRAConfig(rank=4, alpha=8.0))
    n = lora_adapter_params(layers=2, d_model=16, q_dim=16, kv_dim=8, ffn=24, rank=4)
    assert transformer.publish_bytes(cfg)["adapters"] == 4 * n  # float32 adapters
    assert lora_adapter_params(**QWEN25_32B_SHAPE, rank=1) == 64 * 131072


def test_only_dora_holds_several_versions_per_slice():
    preset = PRESETS["paper128_lora"]
    assert scheduler_config(preset, "dora").versions_per_slice == preset.max_staleness + 1
    for mode in ("partial_rollout", "sync", "colocated_sync", "partial_rollout_rounds"):
        assert scheduler_config(preset, mode).versions_per_slice == 1


def test_dora_with_k_plus_one_lora_versions_per_slice_audits_clean(tmp_path):
    """...and its timeline stripes a slice's decode calls by version: the saved spans
    give each version its busy slots, within the slots a slice has."""
    from dora_jax.base import timeline

    preset = dataclasses.replace(PRESETS["paper128_lora"], train_batch_size=64,
                                 rollout_batch_size=96, total_devices=96, trainer_devices=64)
    s = simulate(preset, "dora", 4, str(tmp_path))
    assert s["audit_ok"], s["audit"]
    assert s["versions_per_step"] > 1  # versions decode side by side
    assert s["migrations"] == 0
    assert s["slot_idle"]["version_mismatch"] <= 0.01
    mixed = [sp for sp in timeline.load_json(str(tmp_path / "timeline.json")) if sp.slots]
    assert mixed and all(sp.kind == "decode" and len(sp.slots) > 1 for sp in mixed)
    assert all(sum(sp.slots.values()) <= preset.slots_per_slice + 1e-9 for sp in mixed)
    assert all(sp.version == max(sp.slots) for sp in mixed)  # the slice's newest


def test_a_decode_call_of_several_versions_is_drawn_as_stripes_by_their_slots():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dora_jax.base import timeline

    tl = timeline.Timeline()
    tl.add("slice 0", "decode", 0.0, 1.0, 12, slots={11: 6, 12: 2})
    tl.add("slice 1", "decode", 0.0, 1.0, 12, slots={12: 8})  # one version: no stripes
    tl.add("trainer", "train", 0.0, 1.0, 1)

    def drawn_bars(spans):  # (bottom, height, colour) of each bar one second wide
        fig, ax = plt.subplots()
        timeline.draw(ax, spans)
        plt.close(fig)
        return sorted(((e.y0, e.height, tuple(c.get_facecolor()[0])) for c in ax.collections
                       for e in (path.get_extents() for path in c.get_paths())
                       if abs(e.width - 1.0) < 1e-9), key=lambda b: b[0])

    bars = drawn_bars(tl.spans)
    heights = sorted(round(h, 6) for _, h, _ in bars)
    assert heights == [0.2, 0.6, 0.8, 0.8]  # 6 and 2 of 8 slots; two whole bars
    colours = {round(h, 6): c for _, h, c in bars}
    assert colours[0.6] != colours[0.2]  # neighbouring versions stay apart
    # Ten consecutive versions get ten colours (the colour of v is v mod 10).
    tl2 = [timeline.Span("slice 0", "decode", float(v), v + 1.0, v) for v in range(25, 35)]
    assert len({c for _, _, c in drawn_bars(tl2)}) == 10
