"""Kernels and bytes per run counted from optimised HLO text (rollout/hlo_cost.py): a
module worked by hand, the loops and branches it must follow, XLA's own cost analysis
where it counts right (programs without loops), and a real decode step whose count
grows with its layers."""

import dataclasses

import _rollout_common as rc
import pytest

from dora_jax.rollout import hlo_cost
from dora_jax.rollout.step_cost import step_cost

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
    assert hlo_cost.count_kernels(MODULE) == 11
    # Bytes read and written: the copy 16 + 16; per iteration the add 4 + 4 + 4 and the
    # fusion 16 + 16; per condition the compare 4 + 4 + 1. 32 + 3 * 44 + 4 * 9 = 200.
    assert hlo_cost.count_bytes(MODULE) == 200


def _compiled(fn, *args, donate=()):
    import jax

    return jax.jit(fn, donate_argnums=donate).lower(*args).compile()


def test_bytes_equal_xla_s_cost_analysis_without_loops_and_follow_loops_it_counts_once():
    """A program without loops: our count is XLA's. A scan over 16 layers of 1 MB
    weights: XLA's analysis charges the body once (less than the weights it must
    read), ours 16 times."""
    import jax
    import jax.numpy as jnp

    w_LDD, x_BD = jnp.ones((16, 512, 512)), jnp.ones((8, 512))

    def unrolled(w, x):
        for layer in range(16):
            x = jax.nn.relu(x @ w[layer])
        return jax.nn.softmax(x)

    compiled = _compiled(unrolled, w_LDD, x_BD)
    # Equal under XLA's default flags; the suite's (tests/conftest.py) fuse otherwise,
    # and XLA then charges one fusion's sliced operands a little differently.
    ours, xla = hlo_cost.count_bytes(compiled.as_text()), compiled.cost_analysis()["bytes accessed"]
    assert abs(ours - xla) <= 0.05 * xla, (ours, xla)
    scanned = _compiled(lambda w, x: jax.lax.scan(lambda x, w: (x @ w, None), x, w)[0],
                        w_LDD, x_BD)
    assert scanned.cost_analysis()["bytes accessed"] < w_LDD.nbytes
    # Each iteration copies its layer out of the stack (read, written), then reads it.
    assert 2.9 * w_LDD.nbytes < hlo_cost.count_bytes(scanned.as_text()) < 3.2 * w_LDD.nbytes


def test_every_operand_of_a_long_operand_list_is_counted():
    """XLA's text numbers every fifth operand of a long list (`/*index=5*/%x`): a sum
    of 12 distinct arrays, one fusion, reads all 12."""
    import jax.numpy as jnp

    xs = [jnp.full((256, 256), float(k)) for k in range(12)]
    compiled = _compiled(lambda *xs: sum(xs[1:], xs[0]), *xs)
    text = compiled.as_text()
    assert "/*index=5*/" in text  # the form this test is about
    assert hlo_cost.count_kernels(text) == 1
    assert hlo_cost.count_bytes(text) == 13 * xs[0].nbytes


def test_an_update_in_place_accesses_its_update():
    """Eight rows written into a donated 4 MB buffer, by dynamic-update-slices (XLA
    counts them so) or by one scatter (XLA's default analysis charges it the whole
    buffer, read and written): both are the rows and their indices, and write
    nothing buffer-sized."""
    import jax
    import jax.numpy as jnp

    cache, rows, pos = jnp.zeros((8, 2, 4096, 16)), jnp.ones((8, 2, 16)), jnp.arange(8)

    def scattered(c, u, pos):
        return c.at[jnp.arange(8), :, pos].set(u)

    def sliced(c, u, pos):
        for i in range(8):
            c = jax.lax.dynamic_update_slice(c, u[i][None, :, None], (i, 0, pos[i], 0))
        return c

    rows_bytes = 2 * rows.nbytes
    for fn in (scattered, sliced):
        compiled = _compiled(fn, cache, rows, pos, donate=(0,))
        assert rows_bytes <= hlo_cost.count_bytes(compiled.as_text()) < 2 * rows_bytes
        written = hlo_cost.arrays_written(compiled.as_text())
        assert not [n for n, shapes in written.items() if cache.shape in shapes], written


def test_a_loop_of_unknown_length_and_a_branch():
    unbounded = MODULE.replace(TRIP, "")
    with pytest.raises(hlo_cost.UnboundedLoop, match="main: a while loop"):
        hlo_cost.count_kernels(unbounded)
    assert hlo_cost.bounded_counts(unbounded) == (None, None)
    assert hlo_cost.bounded_counts(MODULE) == (hlo_cost.count_bytes(MODULE),
                                               hlo_cost.count_kernels(MODULE))
    # A conditional launches itself and its largest branch: the body (2) over the
    # condition (1).
    branched = MODULE.replace(
        "while(%t0), condition=%cond, body=%body" + TRIP,
        "conditional(%zero, %t0, %t0), branch_computations={%cond, %body}")
    assert hlo_cost.count_kernels(branched) == 1 + 1 + 2
    with pytest.raises(ValueError, match="no ENTRY computation"):
        hlo_cost.count_kernels("HloModule m\n")


def test_a_decode_step_launches_more_kernels_with_more_layers():
    """The engine's count (rollout.step_cost) on the compiled step: each layer adds its
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
            counts[scan, layers] = step_cost(eng, params)["kernels"]
            jax.clear_caches()
        per_layer = counts[scan, 3] - counts[scan, 2]
        assert per_layer > 0 and counts[scan, 4] - counts[scan, 3] == per_layer, counts
