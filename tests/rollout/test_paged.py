"""Paged KV cache: the page pool's bookkeeping, paged decode attention (the pool read in
place, gathered pages, the TPU and GPU kernels interpreted) against a per-slot numpy
reference, and paged slices against dense ones (same tokens and log-probs), with
shared prompts, preemption, migration between layouts and per-request length limits."""

import dataclasses

import _rollout_common as rc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dora_jax import config as config_lib
from dora_jax.model import paged_attention as pa
from dora_jax.rollout import DecodeSlice, Engine, Request
from dora_jax.rollout.pages import PagePool, PagesExhausted

# ------------------------------------------------------------------ page pool

def test_pool_by_hand():
    pool = PagePool(num_pages=6, page_size=4, slots=3, max_tokens=12)
    assert pool.pages_per_slot == 3
    assert list(pool.assign(0, 6)) == [1, 2]  # 6 positions: 2 pages, fresh
    shared = pool.share(0, 6)  # only the page wholly inside the 6 prompt positions
    assert shared == (1,)
    assert list(pool.assign(1, 6, shared)) == [0, 3]  # page 1 mapped, page 3 its own
    assert pool.num_free == 3 and list(pool.slot_pages(1)) == [1, 3]
    pool.advance(3)  # 6 + 3 = 9 positions: a third page each
    assert list(pool.slot_pages(0)) == [1, 2, 4] and list(pool.slot_pages(1)) == [1, 3, 5]
    with pytest.raises(PagesExhausted):
        pool.assign(2, 12)  # 3 pages, 1 free: refused, nothing changed
    assert pool.num_free == 1 and pool.mapped[2] == 0
    pool.release(0)
    assert pool.num_free == 3  # page 1 is still mapped by slot 1 and held by `shared`
    pool.release_pages(shared)
    pool.release(1)
    assert pool.num_free == 6
    pool.check()
    view = pool.view()
    assert view.flat_pages.shape == (8,) and (view.flat_slots == 3).all()


def test_a_pool_read_in_place_shares_nothing_and_names_each_pages_slot():
    pool = PagePool(num_pages=6, page_size=4, slots=3, max_tokens=12, in_place="always")
    pool.assign(0, 6)
    assert pool.share(0, 6) == ()
    with pytest.raises(ValueError, match="shares no pages"):
        pool.assign(1, 6, (1,))
    write = pool.assign_rows([1, 2], 5, 8, share_first=True)
    assert write.tolist() == [[3, 4], [5, 6]]  # each row writes its own copy
    view = pool.view()
    assert view.flat_pages.shape == view.flat_slots.shape == (0,)
    assert view.page_slots.tolist() == [3, 0, 0, 1, 1, 2, 2]  # page 0: the null page
    assert view.page_starts.tolist() == [0, 0, 4, 0, 4, 0, 4]
    assert pool.flat_buckets() == (0,)
    pool.release(1)
    assert pool.view().page_slots.tolist() == [3, 0, 0, 3, 3, 2, 2]
    pool.check()
    with pytest.raises(ValueError, match="in_place"):
        PagePool(num_pages=6, page_size=4, slots=3, max_tokens=12, in_place="yes")


def test_a_pool_reads_in_place_once_its_mapped_pages_need_the_largest_bucket():
    """in_place="full": 4 slots of 5 pages, flat buckets 8, 16 and 20; 16 mapped pages
    are listed, 17 read in place."""
    pool = PagePool(num_pages=20, page_size=4, slots=4, max_tokens=20, in_place="full")
    assert pool.flat_buckets() == (8, 16, 20)
    for slot in range(3):
        pool.assign(slot, 20)
    pool.assign(3, 4)
    view = pool.view()
    assert view.flat_pages.shape == (16,) and view.page_slots.shape == (0,)
    assert pool.share(0, 8) == ()
    pool.assign(3, 8)
    view = pool.view()
    assert view.flat_pages.shape == (0,) and view.page_slots.shape == (21,)
    assert sorted(view.page_slots[1:].tolist()) == [0] * 5 + [1] * 5 + [2] * 5 + [3] * 2 + [4] * 3
    assert pa.in_place_views("auto", pool_is_dense=True, backend="gpu") == "full"
    assert pa.in_place_views("auto", pool_is_dense=False, backend="gpu") == "never"
    assert pa.in_place_views("auto", pool_is_dense=True, backend="tpu") == "never"
    assert pa.in_place_views("pool", pool_is_dense=False) == "always"
    assert pa.in_place_views("ragged", pool_is_dense=True) == "never"


def test_rows_map_all_or_none_and_share_the_first_slots_whole_pages():
    pool = PagePool(num_pages=6, page_size=4, slots=4, max_tokens=12)
    # 6 positions of an 8-position prefix: slot 0 writes both its pages, slots 1 and 2
    # map slot 0's whole page and write only the second.
    write = pool.assign_rows([0, 1, 2], 6, 8, share_first=True)
    assert write.tolist() == [[1, 2], [0, 3], [0, 4]]
    assert [list(pool.slot_pages(s)) for s in range(3)] == [[1, 2], [1, 3], [1, 4]]
    assert pool.num_free == 2
    pool.release(0)
    with pytest.raises(PagesExhausted):  # 9 positions: 3 pages each, 4 free
        pool.assign_rows([0, 3], 9, 12)
    assert pool.mapped[0] == pool.mapped[3] == 0 and pool.num_free == 3  # none mapped
    pool.check()


@settings(max_examples=300, deadline=None, derandomize=True)
@example([("assign", 0, 9), ("assign", 1, 13), ("assign", 2, 1), ("assign", 3, 13),
          ("assign", 2, 5)])  # refused: the slot's own pages must stay mapped
@example([("assign", 0, 1), ("assign", 1, 13), ("assign", 2, 1), ("assign", 3, 9),
          ("share", 0, 4), ("assign", 0, 13)])  # re-mapping a slot with its shared page
@given(st.lists(st.tuples(st.sampled_from(["assign", "advance", "release", "share",
                                           "unshare", "tighten"]),
                          st.integers(0, 3), st.integers(1, 20)), max_size=40))
def test_pool_invariants_under_any_operations(ops):
    """Whatever the sequence: no page is lost or handed out twice, reference counts
    cover every mapping, a refused request changes nothing, and the flat view lists
    exactly each slot's mapped pages in order."""
    pool = PagePool(num_pages=12, page_size=4, slots=4, max_tokens=20)
    held = []
    for op, slot, n in ops:
        before = (pool.num_free, pool.table.copy())
        try:
            if op == "assign":
                shared = held.pop() if held and n % 2 else ()
                try:
                    pool.assign(slot, n, shared[:pool.pages_for(n)])
                finally:
                    pool.release_pages(shared)
            elif op == "advance":
                pool.advance(n % 6)
            elif op == "release":
                pool.release(slot)
            elif op == "share":
                held.append(pool.share(slot, n))
            elif op == "unshare" and held:
                pool.release_pages(held.pop())
            elif op == "tighten":
                pool.tighten([slot], n)
        except PagesExhausted:
            assert pool.num_free == before[0] and (pool.table == before[1]).all()
        pool.check()
        assert (pool.bound <= pool.mapped * pool.page_size).all()
        view = pool.view()
        real = view.flat_slots < pool.slots
        assert real.sum() == pool.mapped.sum()
        for s in range(pool.slots):
            mine = view.flat_slots == s
            assert list(view.flat_pages[mine]) == list(pool.slot_pages(s))
            assert list(view.flat_starts[mine]) == [4 * j for j in range(pool.mapped[s])]
    for pages in held:
        pool.release_pages(pages)
    for s in range(pool.slots):
        pool.release(s)
    assert pool.num_free == pool.num_pages


# ------------------------------------------------------------------ attention

def _paged_problem(D, seed=0, in_place=False):
    rng = np.random.default_rng(seed)
    B, H, K, ps = 4, 4, 2, 4
    pool = PagePool(num_pages=14, page_size=ps, slots=B, max_tokens=16,
                    in_place="always" if in_place else "never")
    lengths = [7, 16, 0, 3]
    pool.assign(0, 7)
    pool.assign(1, 16, pool.share(0, 7))  # slot 1 maps slot 0's first page
    pool.assign(3, 3)
    q = rng.normal(size=(B, H, D)).astype(np.float32)
    k = rng.normal(size=(K, 15, ps, D)).astype(np.float32)
    v = rng.normal(size=(K, 15, ps, D)).astype(np.float32)
    tables = [list(pool.slot_pages(b)) for b in range(B)]
    return q, k, v, np.array(lengths, np.int32), pool, tables


@pytest.mark.parametrize("impl", ["ragged", "pool"])
def test_paged_attention_equals_per_slot_softmax(impl):
    """Slot 1 maps slot 0's first page (ragged) or a copy of it (pool, read in place);
    slot 2 has no page."""
    q, k, v, lengths, pool, tables = _paged_problem(D=16, in_place=impl == "pool")
    assert (len(set(tables[0]) & set(tables[1])) == 1) == (impl == "ragged")
    view = jax.tree.map(jnp.asarray, pool.view())
    got = jax.jit(pa.paged_attention, static_argnums=(5,))(q, k, v, lengths, view, impl)
    want = rc.paged_attention_reference(q, k, v, lengths, tables)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
    assert not np.asarray(got)[2].any()  # a slot without pages attends to nothing
    other = "ragged" if impl == "pool" else "pool"
    with pytest.raises(ValueError, match="PagePool"):  # a view made for the other
        pa.paged_attention(q, k, v, lengths, view, other)
    assert pa.paged_attention(q, k, v, lengths, view, "auto").shape == q.shape  # resolves


def test_pallas_paged_kernel_in_interpret_mode_matches_reference():
    q, k, v, lengths, pool, tables = _paged_problem(D=128, seed=1)
    lengths[2] = 1  # the TPU kernel needs at least one position per slot
    pool.assign(2, 1)
    tables[2] = list(pool.slot_pages(2))
    view = jax.tree.map(jnp.asarray, pool.view())
    got = pa.paged_attention(q, k, v, lengths, view, "pallas", interpret=True)
    want = rc.paged_attention_reference(q, k, v, lengths, tables)
    np.testing.assert_allclose(np.asarray(got), want, atol=3e-2)  # the kernel's bf16 steps
    assert pa.resolve("auto", "tpu") == "pallas" and pa.resolve("auto", "cpu") == "ragged"
    assert pa.resolve("auto", "gpu", in_place=True) == "pool"
    assert pa.resolve("auto", "tpu", in_place=True) == "pallas"


def test_gpu_paged_kernel_in_interpret_mode_matches_reference():
    """JAX's GPU kernel, interpreted: pages of 16, shared prompt pages, a slot without
    pages, and a slot's pages split over several parallel parts of 1 and 2 pages."""
    rng = np.random.default_rng(2)
    for max_tokens, lengths in ((64, [30, 64, 0, 5]), (512, [300, 17, 0, 512])):
        B, H, K, ps, D = 4, 4, 2, 16, 16
        pool = PagePool(num_pages=4 * max_tokens // ps, page_size=ps, slots=B,
                        max_tokens=max_tokens)
        pool.assign(0, lengths[0])
        pool.assign(1, lengths[1], pool.share(0, min(lengths[0], lengths[1]) // ps * ps))
        pool.assign(3, lengths[3])
        q = rng.normal(size=(B, H, D)).astype(np.float32)
        k, v = (rng.normal(size=(K, pool.num_pages + 1, ps, D)).astype(np.float32)
                for _ in range(2))
        tables = [list(pool.slot_pages(b)) for b in range(B)]
        view = jax.tree.map(jnp.asarray, pool.view())
        got = pa.paged_attention(q, k, v, np.array(lengths, np.int32), view, "pallas_gpu")
        want = rc.paged_attention_reference(q, k, v, lengths, tables)
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
        assert not np.asarray(got)[2].any()
    assert config_lib.gpu_paged_blocks(4, 16, 16) == (4, 1)
    assert config_lib.gpu_paged_blocks(32, 16, 16) == (16, 2)


def test_a_paged_slice_decodes_alike_with_the_gpu_kernel():
    """The engine's decode step with pallas_gpu (interpreted here) gives the ragged
    path's tokens and log-probs, pages of 16 (cache_length 20: two pages a slot)."""
    out = {}
    for impl in ("ragged", "pallas_gpu"):
        ro = dataclasses.replace(rc.rollout(), page_size=16, paged_attention=impl)
        engine = Engine(rc.config("dense").model, ro, rc.meshes()[1][0],
                        sampling_params=rc.SAMPLING["sampled"])
        sl = DecodeSlice(0, engine)
        sl.load_version(0, rc.params("dense", 0))
        out[impl] = _run(sl, _requests(rc.PROMPTS[:2], group_size=2))
    assert out["ragged"].keys() == out["pallas_gpu"].keys()
    for rid, t in out["ragged"].items():
        assert out["pallas_gpu"][rid].response_tokens == t.response_tokens, rid
        np.testing.assert_allclose(out["pallas_gpu"][rid].behaviour_logprobs,
                                   t.behaviour_logprobs, atol=1e-5)


def test_the_gpu_kernel_refuses_pages_it_cannot_tile():
    c = rc.config("dense")
    ok = dataclasses.replace(c, rollout=dataclasses.replace(
        c.rollout, kv_cache="paged", paged_attention="pallas_gpu", page_size=16))
    assert ok.rollout.paged_attention == "pallas_gpu"
    with pytest.raises(config_lib.ConfigError, match="rollout.page_size"):
        dataclasses.replace(ok, rollout=dataclasses.replace(ok.rollout, page_size=12))
    with pytest.raises(config_lib.ConfigError, match="rollout.page_size.*under 16"):
        dataclasses.replace(ok, rollout=dataclasses.replace(ok.rollout, page_size=4))
    with pytest.raises(config_lib.ConfigError, match="model.head_dim"):
        dataclasses.replace(ok, model=dataclasses.replace(ok.model, head_dim=8))


# ------------------------------------------------------------------ slices

def _requests(prompts=rc.PROMPTS, group_size=1, **kw):
    return [Request(group_id=i, prompt_id=i, sample_index=k, prompt_tokens=q,
                    seed=1000 * i + k, version=0, **kw)
            for i, q in enumerate(prompts) for k in range(group_size)]


def _run(sl, reqs):
    for r in reqs:
        sl.submit(r)
    return {t.request_id: t for t in sl.drain()}


@pytest.mark.parametrize("kv_pages,impl,in_place", [
    (0, "auto", "full"), (0, "pool", "always"), (0, "ragged", "never"), (8, "auto", "never")])
def test_paged_slice_equals_dense_slice(kv_pages, impl, in_place, monkeypatch):
    """Groups of 3 samples, more requests than slots; the pool read in place (pool),
    its mapped pages gathered (ragged: the groups share their prompt pages), or
    either by how many are mapped (`auto` with the default pool); with a pool of 8
    pages (a full-length request needs 5) requests wait for pages and are preempted.
    Tokens, log-probs and versions equal the dense cache's."""
    reqs = _requests(rc.PROMPTS[:4], group_size=3)
    dense = rc.make_slice(0, "dense", "sampled", 0, kv_cache="dense")
    want = {}
    for i in range(0, len(reqs), rc.SLOTS):
        want.update(_run(dense, reqs[i:i + rc.SLOTS]))
    paged = rc.make_slice(0, "dense", "sampled", 1, kv_pages=kv_pages, paged_attention=impl)
    pool = paged.engine.pages
    assert pool.in_place == in_place
    views, view = [], pool.view
    monkeypatch.setattr(pool, "view", lambda: views.append(view()) or views[-1])
    got = {}
    queue = list(reqs)
    while queue or paged.num_requests:
        while queue and paged.num_free_slots:
            paged.submit(queue.pop(0))
        got.update({t.request_id: t for t in paged.step()})
    assert got.keys() == want.keys()
    for rid, t in want.items():
        assert got[rid].response_tokens == t.response_tokens, rid
        np.testing.assert_allclose(got[rid].behaviour_logprobs, t.behaviour_logprobs,
                                   atol=1e-5)
        assert got[rid].versions == t.versions
    kinds = {len(v.page_slots) > 0 for v in views}
    assert kinds == {"never": {False}, "always": {True}, "full": {False, True}}[in_place]
    pool.check()
    assert pool.num_used == 0  # every page came back
    assert paged.stats.prefills < len(reqs)  # groups shared their prompt
    if kv_pages:
        assert paged.stats.preempted > 0 and paged.stats.peak_pages <= kv_pages


def test_group_maps_its_prompt_pages_once():
    """Four samples of an 8-token prompt, pages of 4 (gathered pages): the prompt's 2
    pages are mapped by all four; after the first call (5 steps: positions 8..12) each
    has 2 pages of its own: 2 + 4 x 2 = 10 pages, where four separate copies use 16
    (a default pool under `auto`, which may read it in place)."""
    for impl, used in (("ragged", 10), ("auto", 16)):
        sl = rc.make_slice(0, "dense", "sampled", 2, paged_attention=impl)
        for r in _requests([rc.PROMPTS[2]], group_size=4):
            sl.submit(r)
        sl.step()
        assert sl.engine.pages.num_used == used, impl
        sl.drain()
        assert sl.engine.pages.num_used == 0


@pytest.mark.parametrize("src_layout,dst_layout", [("paged", "dense"), ("dense", "paged")])
def test_migration_between_layouts_continues_identically(src_layout, dst_layout):
    reqs = _requests(rc.PROMPTS[:rc.SLOTS])
    want = _run(rc.make_slice(0, "dense", "greedy", 0, kv_cache="dense"), reqs)
    src = rc.make_slice(1, "dense", "greedy", 1, decode_steps=1, kv_cache=src_layout)
    for r in reqs:
        src.submit(r)
    got = {}
    for _ in range(6):
        got.update({t.request_id: t for t in src.step()})
    moved = src.export_requests()
    assert any(len(f.response_tokens) > 2 for f in moved)
    dst = rc.make_slice(2, "dense", "greedy", 2, decode_steps=1, kv_cache=dst_layout)
    dst.import_requests(moved)
    got.update({t.request_id: t for t in dst.drain()})
    for rid, t in want.items():
        assert got[rid].response_tokens == t.response_tokens
    if src_layout == "paged":
        assert src.engine.pages.num_used == 0


def test_max_new_tokens_ends_a_request_early():
    reqs = _requests(rc.PROMPTS[:3])
    want = _run(rc.make_slice(0, "dense", "greedy", 0), reqs)
    sl = rc.make_slice(0, "dense", "greedy", 0)
    got = _run(sl, _requests(rc.PROMPTS[:3], max_new_tokens=3))
    for rid, t in want.items():
        assert got[rid].response_tokens == t.response_tokens[:3]
        assert got[rid].finish_reason == ("eos" if len(t.response_tokens) <= 3 else "length")


def test_pool_smaller_than_one_request_is_refused_naming_the_field():
    cfg = rc.config("dense")
    with pytest.raises(config_lib.ConfigError, match="rollout.kv_pages"):
        dataclasses.replace(cfg.rollout, kv_pages=1)
    sl = rc.make_slice(3, "dense", "greedy", 3)
    other = DecodeSlice(4, sl.engine)  # a second decode state on the same engine
    other.load_version(0, rc.params("dense", 0))
    with pytest.raises(RuntimeError, match="page"):
        sl.submit(_requests(rc.PROMPTS[:1])[0])
        sl.step()
