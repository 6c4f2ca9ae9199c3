"""DecodeSlice: continuous batching, versions (C1), migration, partial-rollout reload,
bad input. References are full forwards (tests/_rollout_common.py) or the same
request run alone."""

import ast
import json
import pathlib

import _rollout_common as rc
import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from dora_jax.config import SLICE_MESH_AXES, TRAINER_RULES
from dora_jax.model.sharding import param_shardings
from dora_jax.rollout import (
    DecodeSlice,
    Engine,
    Request,
    RolloutError,
    SlotOverflowError,
    Trajectory,
    VersionMismatchError,
)
from dora_jax.rollout.slice_decode import DecodeCalls

# Arrival step of each of the six prompts: more requests than slots, staggered.
ARRIVALS = [0, 0, 1, 1, 3, 6]


def requests(version=0, group0=0, seeds=None):
    return [Request(group_id=group0 + i, prompt_id=f"p{i}", sample_index=0, prompt_tokens=q,
                    seed=i + 100 if seeds is None else seeds[i], version=version)
            for i, q in enumerate(rc.PROMPTS)]


def run_staggered(sl, reqs, arrivals, returned_at=None):
    """Submits each request at its arrival step (or the first step after with a
    free slot), steps until all finish; returns {request_id: Trajectory} and fills
    `returned_at` with the step() call that returned each."""
    queue = sorted(zip(arrivals, range(len(reqs))))
    out, step = {}, 0
    while queue or sl.num_requests:
        while queue and queue[0][0] <= step and sl.num_free_slots:
            sl.submit(reqs[queue.pop(0)[1]])
        for t in sl.step():
            out[t.request_id] = t
            if returned_at is not None:
                returned_at[t.request_id] = step
        step += 1
    assert len(out) == len(reqs)
    return out


def counting(counts: dict, name: str, fn):
    """`fn`, counting its calls in counts[name]."""
    def wrapped(*args, **kwargs):
        counts[name] += 1
        return fn(*args, **kwargs)
    return wrapped


def ideal_schedule(lengths, arrivals, slots, lag):
    """When an ideal continuous batcher returns each request, and how many generate
    steps it runs. A request admitted at step t has token 0 from its prefill and
    token k from the generate of step t+k-1, so its last token (n-1) comes at step
    t + max(n-2, 0); it is returned `lag` steps later and its slot is free for the
    next step's submissions. Generate runs at every step some request is held."""
    queue = sorted(zip(arrivals, range(len(lengths))))
    held, returned, busy_steps, t = [], {}, set(), 0
    while queue or held:
        held = [(a, r) for a, r in held if r >= t]
        while queue and queue[0][0] <= t and len(held) < slots:
            i = queue.pop(0)[1]
            returned[i] = t + max(lengths[i] - 2, 0) + lag
            held.append((t, returned[i]))
        busy_steps |= {u for a, r in held for u in range(a, r + 1)}
        t += 1
    return returned, len(busy_steps)


@pytest.mark.parametrize("lookahead,decode_steps", [(True, 1), (False, 1), (True, 5)])
def test_continuous_batching_greedy_equals_full_forward(lookahead, decode_steps):
    sl = rc.make_slice(0, "dense", "greedy", 0, lookahead=lookahead, decode_steps=decode_steps)
    reqs = requests()
    returned_at = {}
    got = run_staggered(sl, reqs, ARRIVALS, returned_at)
    want = rc.greedy_reference("dense", rc.params("dense", 0), rc.PROMPTS, rc.eos_id())
    lengths = set()
    for r, ref in zip(reqs, want):
        t = got[r.request_id]
        assert t.response_tokens == ref
        assert t.finish_reason == ("eos" if ref[-1] == rc.eos_id() else "length")
        assert t.versions == [[0, len(ref)]] and t.slice_ids == [0]
        assert t.t_submit <= t.t_start <= t.t_finish
        assert Trajectory.from_dict(json.loads(json.dumps(t.to_dict()))) == t
        lengths.add(len(ref))
    assert len(lengths) > 1 and len(reqs) > sl.num_slots  # slots were refilled
    # Every token but each request's first (from prefill) took one busy slot-step.
    st = sl.stats
    assert st.busy_slot_steps == sum(len(ref) - 1 for ref in want)
    assert st.total_slot_steps == sl.num_slots * st.generate_steps
    assert st.prefills == st.finished == len(reqs) and sl.num_free_slots == sl.num_slots
    if decode_steps > 1:
        return  # a call of n tokens: the one-token schedule below does not apply
    # Freed slots are refilled for the next generate step (with lookahead, the host
    # learns of a finish one step later): return steps and the number of generate
    # steps match an ideal continuous batcher's, exactly.
    want_at, want_steps = ideal_schedule([len(r) for r in want], ARRIVALS, sl.num_slots,
                                         lag=int(lookahead))
    assert [returned_at[r.request_id] for r in reqs] == [want_at[i] for i in range(len(reqs))]
    assert st.generate_calls == want_steps


def test_tokens_per_call_do_not_change_samples():
    """n tokens per generate call gives exactly the tokens and log-probs of one token
    per call, for the same seeds (requests ending mid-call included)."""
    reqs = requests()
    one = run_staggered(rc.make_slice(0, "dense", "sampled", 0, decode_steps=1), reqs,
                        ARRIVALS)
    five = run_staggered(rc.make_slice(0, "dense", "sampled", 0, decode_steps=5), reqs,
                         ARRIVALS)
    assert {len(t.response_tokens) % 5 for t in one.values()} - {0}  # some end mid-call
    for r in reqs:
        assert five[r.request_id].response_tokens == one[r.request_id].response_tokens
        np.testing.assert_allclose(five[r.request_id].behaviour_logprobs,
                                   one[r.request_id].behaviour_logprobs, rtol=0, atol=1e-6)
        assert five[r.request_id].finish_reason == one[r.request_id].finish_reason


def test_continuous_batching_sampled_equals_alone():
    sl = rc.make_slice(1, "dense", "sampled", 1)
    reqs = requests()
    together = run_staggered(sl, reqs, ARRIVALS)
    for r in reqs:  # each alone in an otherwise empty slice
        sl.submit(r)
        (alone,) = sl.drain()
        t = together[r.request_id]
        assert t.response_tokens == alone.response_tokens
        assert t.behaviour_logprobs == alone.behaviour_logprobs
        want = rc.logprob_reference("dense", rc.params("dense", 0), r.prompt_tokens,
                                    t.response_tokens, rc.TEMPERATURE)
        np.testing.assert_allclose(t.behaviour_logprobs, want, rtol=0, atol=2e-5)
    # A different seed gives a different sample.
    other = requests(seeds=[7] * len(reqs))[2]
    sl.submit(other)
    assert sl.drain()[0].response_tokens != together[other.request_id].response_tokens


def test_migration_mid_sequence_continues_identically():
    # Source on device 5 (its params come from the trainer mesh), destination on 6.
    trainer_mesh = rc.meshes()[0]
    p0 = rc.params("dense", 0)
    trainer_params = jax.device_put(p0, param_shardings(p0, trainer_mesh, TRAINER_RULES))
    src = DecodeSlice(1, rc.engine("dense", "sampled", 1, decode_steps=1))
    src.load_version(0, trainer_params)
    reqs = requests(group0=50)
    reference = {}
    for r in reqs:
        src.submit(r)
        reference[r.request_id] = src.drain()[0]
    by_length = sorted(reqs, key=lambda r: -len(reference[r.request_id].response_tokens))
    moved, stay, left = by_length[:3], by_length[3], by_length[4]
    assert len(reference[moved[-1].request_id].response_tokens) > 4
    for r in moved + [stay]:
        src.submit(r)
    for _ in range(3):
        assert src.step() == []
    dst = DecodeSlice(2, rc.engine("dense", "sampled", 2, decode_steps=1))
    dst.load_version(1, rc.params("dense", 1))
    out = src.export_requests([r.request_id for r in moved])
    assert [len(f.response_tokens) for f in out] == [4, 4, 4]
    # Only the bucket holding prompt + 4 tokens moves, not the whole cache (20).
    assert [f.prefix.cache.length for f in out] == [
        8 if len(f.request.prompt_tokens) + 4 <= 8 else 16 for f in out]
    assert src.num_requests == 1 and src.num_free_slots == rc.SLOTS - 1
    with pytest.raises(VersionMismatchError):
        dst.import_requests(out)  # versions differ: refused, nothing taken
    assert dst.num_requests == 0
    dst.load_version(0, p0)
    dst.import_requests(out)
    assert dst.held_versions == {0} and dst.num_running == 3
    results = {t.request_id: t for t in dst.drain() + src.drain()}
    for r in moved + [stay]:
        t, ref = results[r.request_id], reference[r.request_id]
        assert t.response_tokens == ref.response_tokens
        assert t.behaviour_logprobs == ref.behaviour_logprobs
        assert t.versions == ref.versions
        assert t.slice_ids == ([1, 2] if r in moved else [1])
    assert dst.stats.migrated_in == src.stats.migrated_out == 3
    # A waiting (not yet started) request can move as well and starts on dst.
    src.submit(left)
    (f,) = src.export_requests()
    assert f.prefix is None and f.response_tokens == []
    dst.import_requests([f])
    (t,) = dst.drain()
    assert t.response_tokens == reference[left.request_id].response_tokens


def test_load_version_refuses_other_versions_then_follows_new_params():
    sl = rc.make_slice(0, "dense", "greedy", 0)
    p0, p1 = rc.params("dense", 0), rc.params("dense", 1)
    ref0 = rc.greedy_reference("dense", p0, rc.PROMPTS, rc.eos_id())
    prompt = rc.PROMPTS[max(range(len(ref0)), key=lambda j: len(ref0[j]))]
    sl.submit(Request(1, "a", 0, prompt, seed=1, version=0))
    sl.step()
    with pytest.raises(VersionMismatchError, match="version"):
        sl.load_version(1, p1)
    assert sl.version == 0
    (t0,) = sl.drain()
    assert t0.response_tokens == max(ref0, key=len)
    loads = sl.stats.weight_loads
    seconds = sl.load_version(1, p1)
    assert seconds > 0 and sl.stats.weight_loads == loads + 1 and sl.versions.load_log[-1][0] == 1
    with pytest.raises(VersionMismatchError):
        sl.submit(Request(2, "a", 0, prompt, seed=1, version=0))
    sl.submit(Request(2, "a", 0, prompt, seed=1, version=1))
    (t1,) = sl.drain()
    want1 = rc.greedy_reference("dense", p1, [prompt], rc.eos_id())[0]
    assert t1.response_tokens == want1 != t0.response_tokens
    assert t1.versions == [[1, len(want1)]]
    sl.load_version(0, p0)  # leave the shared engine's slice as other tests expect


def test_interrupt_and_reload_records_two_versions():
    sl = rc.make_slice(0, "dense", "greedy", 0, decode_steps=1)
    p0, p1 = rc.params("dense", 0), rc.params("dense", 1)
    ref0 = rc.greedy_reference("dense", p0, rc.PROMPTS, rc.eos_id())
    i = max(range(len(ref0)), key=lambda j: len(ref0[j]))  # the longest response
    prompt = rc.PROMPTS[i]
    assert len(ref0[i]) > 6
    sl.submit(Request(9, "x", 0, prompt, seed=3, version=0))
    for _ in range(4):
        sl.step()
    m = 5  # tokens so far: 1 from prefill + 4 generate steps
    # prompt + 5 tokens > max_prefill_length: re-prefill uses an extra bucket.
    assert len(prompt) + m > rc.MAX_PROMPT
    sl.interrupt_and_reload(1, p1)
    assert sl.version == 1 and sl.held_versions == {1} and sl.stats.interrupts == 1
    (t,) = sl.drain()
    # The prompt ran under each version; the 5 tokens so far ran again under v1.
    assert (sl.stats.prefill_tokens, sl.stats.reprefill_tokens) == (2 * len(prompt), m)
    head = t.response_tokens[:m]
    assert head == ref0[i][:m]
    tail = rc.greedy_reference("dense", p1, [list(prompt) + head], rc.eos_id(),
                               steps=rc.MAX_DECODE - m)[0]
    assert t.response_tokens[m:] == tail
    assert t.versions == [[0, m], [1, len(tail)]] and t.version == 0
    assert t.token_versions() == [0] * m + [1] * len(tail)
    want = rc.logprob_reference("dense", p1, list(prompt) + head, tail, 1.0)
    np.testing.assert_allclose(t.behaviour_logprobs[m:], want, rtol=0, atol=2e-5)
    assert sl.engine.pages.num_used == 0  # the re-inserted slot's pages went back too
    sl.load_version(0, p0)


def test_bad_input_gives_clear_errors_and_slice_stays_usable():
    empty = DecodeSlice(7, rc.engine("dense", "greedy", 0, decode_steps=1))
    with pytest.raises(RolloutError, match="no params loaded"):
        empty.submit(Request(0, "a", 0, [1, 2], seed=0, version=0))
    sl = rc.make_slice(0, "dense", "greedy", 0, decode_steps=1)
    with pytest.raises(ValueError, match="exceeds max_prefill_length"):
        sl.submit(Request(0, "a", 0, list(range(2, 2 + rc.MAX_PROMPT + 1)), seed=0, version=0))
    with pytest.raises(ValueError, match="empty prompt"):
        sl.submit(Request(0, "a", 0, [], seed=0, version=0))
    with pytest.raises(ValueError, match="token ids"):
        sl.submit(Request(0, "a", 0, [5, 128], seed=0, version=0))
    with pytest.raises(ValueError, match="seed"):
        sl.submit(Request(0, "a", 0, [5, 6], seed=-1, version=0))
    reqs = requests()[:rc.SLOTS]
    for r in reqs:
        sl.submit(r)
    with pytest.raises(SlotOverflowError, match="free slot"):
        sl.submit(requests(group0=100)[4])
    with pytest.raises(RolloutError, match="duplicate"):
        sl.submit(reqs[0])
    sl.step()
    (f,) = sl.export_requests([reqs[0].request_id])
    extra = requests(group0=100)[4]
    sl.submit(extra)
    with pytest.raises(SlotOverflowError):
        sl.import_requests([f])
    with pytest.raises(KeyError):
        sl.export_requests([(12345, 0)])
    assert sl.num_requests == rc.SLOTS and sl.num_free_slots == 0
    got = {t.request_id: t.response_tokens for t in sl.drain()}
    sl.import_requests([f])  # the refused import still works once a slot is free
    got.update({t.request_id: t.response_tokens for t in sl.drain()})
    want = rc.greedy_reference("dense", rc.params("dense", 0), rc.PROMPTS[:rc.SLOTS + 1],
                               rc.eos_id())
    assert [got[r.request_id] for r in reqs + [extra]] == want


@pytest.mark.parametrize("model,shape", [("dense", (2, 1)), ("moe", (1, 2))])
def test_sharded_slice_decodes_and_takes_migrated_requests(model, shape):
    # A 2-device slice (tensor=2 for dense: KV heads and the cache split; expert=2
    # for MoE) takes requests migrated from a 1-device slice mid-sequence: the KV
    # caches are resharded on import and greedy decoding still equals the full forward.
    devices = rc.meshes()[1][2].devices.flat[0], rc.meshes()[1][3].devices.flat[0]
    mesh = Mesh(np.array(devices).reshape(shape), SLICE_MESH_AXES)
    dst = DecodeSlice(3, Engine(rc.config(model).model, rc.rollout(1), mesh,
                          sampling_params=rc.SAMPLING["greedy"]))
    p0 = rc.params(model, 0)
    dst.load_version(0, p0)
    src = rc.make_slice(0, model, "greedy", 0, decode_steps=1)
    reqs = requests()[:rc.SLOTS]
    for r in reqs:
        src.submit(r)
    src.step()
    src.step()
    dst.import_requests(src.export_requests())
    got = {t.request_id: t for t in dst.drain()}
    want = rc.greedy_reference(model, p0, rc.PROMPTS[:rc.SLOTS], rc.eos_id())
    assert [got[r.request_id].response_tokens for r in reqs] == want
    assert all(got[r.request_id].slice_ids == [0, 3] for r in reqs)


@pytest.mark.parametrize("kv_cache,samples,calls_made", [
    ("paged", 6, (1, 2, 3)), ("dense", 6, (1, 2, 3)), ("paged", 3, (1, 1, 2))])
def test_a_group_is_prefilled_once_and_samples_as_if_alone(monkeypatch, kv_cache, samples,
                                                           calls_made):
    """Six samples of one prompt submitted together on four slots: one forward pass
    over the prompt, and one call puts the four that start together in their slots;
    the last two start from its prefix as slots free. Three: two start together (a
    power of two, the shapes warm-up compiles), the third from the prefix. Every
    sample's tokens and log-probs equal those of the same request decoded alone (its
    own prefill)."""
    sl = rc.make_slice(1, "dense", "sampled", 1, kv_cache=kv_cache)
    calls = {"prefill": 0, "resample": 0, "insert": 0}
    jitted = sl.engine._jit
    monkeypatch.setattr(sl.engine, "_jit", jitted._replace(
        **{name: counting(calls, name, getattr(jitted, name)) for name in calls}))
    # Seeds whose samples end at different lengths (4, 11, 12, 12, ...): slots free
    # one at a time while the group is still held (checked below).
    group = [Request(group_id=5, prompt_id="p", sample_index=k, prompt_tokens=rc.PROMPTS[2],
                     seed=300 + k, version=0) for k in range(samples)]
    for r in group[:rc.SLOTS]:
        sl.submit(r)
    together = {t.request_id: t for t in sl.step()}
    for r in group[rc.SLOTS:]:
        while not sl.num_free_slots:
            together.update((t.request_id, t) for t in sl.step())
        sl.submit(r)
    together.update((t.request_id, t) for t in sl.drain())
    assert calls == dict(zip(("prefill", "resample", "insert"), calls_made)), calls
    assert (sl.stats.prefills, sl.stats.prefills_shared) == (1, samples - 1)
    assert (sl.stats.prefill_tokens, sl.stats.reprefill_tokens) == (len(rc.PROMPTS[2]), 0)
    assert len({tuple(t.response_tokens) for t in together.values()}) > 1  # distinct samples
    assert len({len(together[r.request_id].response_tokens) for r in group[:rc.SLOTS]}) > 1
    monkeypatch.undo()
    for r in group:
        alone = rc.make_slice(1, "dense", "sampled", 1, kv_cache=kv_cache)
        alone.submit(r)
        (t,) = alone.drain()
        assert alone.stats.prefills == 1
        assert together[r.request_id].response_tokens == t.response_tokens
        # Four busy slots read the pool in place, one alone its gathered pages: the
        # same sums in another order.
        np.testing.assert_allclose(together[r.request_id].behaviour_logprobs,
                                   t.behaviour_logprobs, rtol=0, atol=1e-5)
    # The prefix is forgotten once the group has left the slice.
    assert not sl.memory.prefixes


def test_a_load_places_params_once(monkeypatch):
    """load_version and interrupt_and_reload place params on the slice's mesh with
    one load_params call and one device_put (in host memory, as on a CPU: the version
    packed in one buffer, then cut into its layers on the mesh): none for params
    already placed for this engine, none of the path check for a tree structure seen
    before."""
    from dora_jax.rollout import placement

    eng = rc.engine("dense", "greedy", 0, decode_steps=1)  # the request runs on under v2
    p0 = rc.params("dense", 0)
    trainer_mesh = rc.meshes()[0]
    on_trainer = jax.device_put(p0, param_shardings(p0, trainer_mesh, TRAINER_RULES))
    placed = eng.load_params(on_trainer)
    sl = DecodeSlice(9, eng)
    counts = {"load_params": 0, "device_put": 0, "paths": 0, "moved": 0}
    put = jax.device_put

    def device_put(x, *args, **kwargs):
        counts["moved"] += len(jax.tree.leaves(x))
        return put(x, *args, **kwargs)

    leaves = 1  # one float32 buffer
    assert {x.dtype for x in jax.tree.leaves(p0)} == {np.dtype("float32")}
    assert len(jax.tree.leaves(p0)) < len(placed.leaves)  # the decode layout: layers apart
    monkeypatch.setattr(eng, "load_params", counting(counts, "load_params", eng.load_params))
    monkeypatch.setattr(jax, "device_put", counting(counts, "device_put", device_put))
    monkeypatch.setattr(placement, "_leaf_paths", counting(counts, "paths", placement._leaf_paths))
    sl.load_version(0, on_trainer)
    assert counts == {"load_params": 1, "device_put": 1, "paths": 0, "moved": leaves}
    sl.load_version(1, placed)
    assert counts == {"load_params": 2, "device_put": 1, "paths": 0, "moved": leaves}
    assert sl.params is placed
    sl.submit(Request(group_id=0, prompt_id="p", sample_index=0, prompt_tokens=rc.PROMPTS[0],
                      seed=1, version=1))
    sl.step()
    sl.interrupt_and_reload(2, on_trainer)
    assert counts == {"load_params": 3, "device_put": 2, "paths": 0, "moved": 2 * leaves}
    assert sl.version == 2 and sl.stats.weight_loads == 3
    (t,) = sl.drain()
    assert [v for v, _ in t.versions] == [1, 2]


ROLLOUT = pathlib.Path(__file__).resolve().parents[2] / "dora_jax" / "rollout"
# The engine's programs that donate the decode state passed to them.
DONATING = {"init_decode_state", "insert", "bulk_insert", "generate", "generate_steps"}


def _scopes(tree):
    """(node, "Class.method" of the innermost class and function around it)."""
    def walk(node, names):
        for child in ast.iter_child_nodes(node):
            inner = names
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = names + [child.name]
            yield child, ".".join(inner)
            yield from walk(child, inner)
    return walk(tree, [])


def test_the_decode_state_is_replaced_in_one_method_only():
    """Every donating program runs on a slice's decode state through
    `DecodeCalls._run`, the one place the state attribute is assigned: a caller
    elsewhere could keep (and pass again) a state that a program already donated."""
    assigned, donating = [], []
    for path in sorted(ROLLOUT.glob("*.py")):
        for node, scope in _scopes(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                       else [])
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and t.attr in ("state", "_state"):
                        assigned.append((path.name, scope))
            if (path.name.startswith("slice") and isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute) and node.func.attr in DONATING
                    and ast.unparse(node.func.value).endswith("engine")):
                donating.append((path.name, scope.split(".")[0]))
    assert assigned == [("slice_decode.py", "DecodeCalls._run")]
    assert donating and set(donating) == {("slice_decode.py", "DecodeCalls")}


def test_each_donating_call_consumes_the_state_and_the_old_one_is_deleted(monkeypatch):
    """Prefills (alone, a group's together, from the group's prefix, a re-prefill after
    a reload), generate calls and a migration in: each program is given the state the
    last one kept and deletes it (donation deletes on CPU too; a deleted buffer passed
    again raises), and the slices finish their requests."""
    live: dict = {}  # id -> the state each slice holds now
    runs = []
    run = DecodeCalls._run

    def checked(self, program):
        given = self._state
        assert given is None or live.get(id(given)) is given, "a state no slice holds"
        out = run(self, program)
        if given is not None:
            assert all(x.is_deleted() for x in jax.tree.leaves(given))
            del live[id(given)]
        assert not any(x.is_deleted() for x in jax.tree.leaves(self._state))
        live[id(self._state)] = self._state
        runs.append(program)
        return out
    monkeypatch.setattr(DecodeCalls, "_run", checked)
    src = rc.make_slice(0, "dense", "sampled", 0, decode_steps=1)
    group = [Request(group_id=7, prompt_id="g", sample_index=k, prompt_tokens=rc.PROMPTS[1],
                     seed=300 + k, version=0) for k in range(3)]
    for r in requests()[:1] + group:
        src.submit(r)
    for _ in range(3):
        src.step()
    assert src.stats.prefills_shared == 2  # two together, the third from the prefix
    dst = rc.make_slice(1, "dense", "sampled", 1, decode_steps=1)
    dst.import_requests(src.export_requests([group[0].request_id]))
    src.interrupt_and_reload(1, rc.params("dense", 1))
    done = src.drain() + dst.drain()
    assert len(done) == 4 and src.idle and dst.idle
    assert src.stats.reprefill_tokens and dst.stats.migrated_in == 1
    assert len(runs) > 10
    assert set(live) == {id(src.calls.state), id(dst.calls.state)}


def test_a_migration_to_another_process_prefills_again_and_continues_identically():
    """Between processes the KV cache stays behind (runtime/slice_process.without_kv)
    and the records cross the wire: the destination prefills the tokens so far again
    under the same version and samples on as the source would have."""
    from dora_jax.runtime import slice_process, wire

    src = DecodeSlice(1, rc.engine("dense", "sampled", 1, decode_steps=1))
    src.load_version(0, rc.params("dense", 0))
    reqs = requests(group0=80)
    reference = {}
    for r in reqs:
        src.submit(r)
        reference[r.request_id] = src.drain()[0]
    moved = sorted(reqs, key=lambda r: -len(reference[r.request_id].response_tokens))[:2]
    assert len(reference[moved[-1].request_id].response_tokens) > 4
    for r in moved:
        src.submit(r)
    for _ in range(3):
        assert src.step() == []
    out = slice_process.without_kv(src.export_requests([r.request_id for r in moved]))
    assert all(f.prefix is None and len(f.response_tokens) == 4 for f in out)
    _, fields = wire.decode(wire.encode("exported", records=out))
    dst = DecodeSlice(2, rc.engine("dense", "sampled", 2, decode_steps=1))
    dst.load_version(0, rc.params("dense", 0))
    dst.import_requests(fields["records"])
    results = {t.request_id: t for t in dst.drain()}
    for r in moved:
        t, ref = results[r.request_id], reference[r.request_id]
        assert t.response_tokens == ref.response_tokens and t.versions == ref.versions
        np.testing.assert_allclose(t.behaviour_logprobs, ref.behaviour_logprobs, atol=1e-5)
        assert t.slice_ids == [1, 2]
    assert dst.stats.reprefill_tokens >= 8  # the 4 tokens of each, run again
