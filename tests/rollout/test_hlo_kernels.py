"""Kernels per run counted from optimised HLO text (rollout/hlo_kernels.py): a module
worked by hand, the loops and branches it must follow, and a real decode step whose
count grows with its layers."""

import dataclasses

import _rollout_common as rc
import pytest

from dora_jax.rollout import hlo_kernels

# By hand: the entry's copy (1); the loop runs its body 3 times (an add and a fusion:
# 2 each, the fusion's own instructions launch nothing more) and its condition 4 times
# (a compare: 1 each); parameters, constants, tuples and get-tuple-elements launch
# nothing. 1 + 3 * 2 + 4 * 1 = 11.
TRIP = ', backend_config={"known_trip_count":{"n":"3"}}'
MODULE = """HloModule m, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %two = f32[] constant(2)
  %b = f32[4]{0} broadcast(%two), dimensions={}
  ROOT %m = f32[4]{0} multiply(%x, %b)
}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[4]{0} get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  %w = f32[4]{0} fusion(%v), kind=kLoop, calls=%fused, metadata={op_name="jit(f)/mul(x)"}
  ROOT %t = (s32[], f32[4]{0}) tuple(%j, %w)
}

%cond (p.1: (s32[], f32[4])) -> pred[] {
  %p.1 = (s32[], f32[4]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %three), direction=LT
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %c = f32[4]{0} copy(%a)
  %zero = s32[] constant(0)
  %t0 = (s32[], f32[4]{0}) tuple(%zero, %c)
  %loop = (s32[], f32[4]{0}) while(%t0), condition=%cond, body=%body""" + TRIP + """
  ROOT %r = f32[4]{0} get-tuple-element(%loop), index=1
}
"""


def test_a_module_worked_by_hand():
    assert hlo_kernels.count_kernels(MODULE) == 11


def test_a_loop_of_unknown_length_and_a_branch():
    unbounded = MODULE.replace(TRIP, "")
    with pytest.raises(hlo_kernels.UnboundedLoop, match="main: a while loop"):
        hlo_kernels.count_kernels(unbounded)
    # A conditional launches itself and its largest branch: the body (2) over the
    # condition (1).
    branched = MODULE.replace(
        "while(%t0), condition=%cond, body=%body" + TRIP,
        "conditional(%zero, %t0, %t0), branch_computations={%cond, %body}")
    assert hlo_kernels.count_kernels(branched) == 1 + 1 + 2
    with pytest.raises(ValueError, match="no ENTRY computation"):
        hlo_kernels.count_kernels("HloModule m\n")


def test_a_decode_step_launches_more_kernels_with_more_layers():
    """The engine's count (Engine.step_cost) on the compiled step: each layer adds its
    attention and MLP kernels, by the same number, whether scanned or unrolled."""
    import jax

    from dora_jax.model import transformer
    from dora_jax.rollout.engine import Engine

    cfg = rc.config("dense")
    counts = {}
    for scan in (True, False):
        for layers in (2, 3, 4):
            model = dataclasses.replace(cfg.model, num_layers=layers, scan_layers=scan)
            eng = Engine(model, rc.rollout(1, "dense", 0), rc.meshes()[1][0])
            params = eng.load_params(transformer.create(model, 0)[1])
            counts[scan, layers] = eng.step_cost(params)["kernels"]
            jax.clear_caches()
        per_layer = counts[scan, 3] - counts[scan, 2]
        assert per_layer > 0 and counts[scan, 4] - counts[scan, 3] == per_layer, counts
