"""Per-token versions, run-length encoded, worked by hand."""

from dora_jax.base import versions


def test_extend_merges_a_run_and_ignores_nothing_added():
    runs = []
    assert versions.extend(runs, 3, 2) is runs
    versions.extend(runs, 3, 1)
    versions.extend(runs, 4, 0)
    versions.extend(runs, 4, 2)
    assert runs == [[3, 3], [4, 2]]


def test_encode_expand_and_count():
    runs = versions.encode([(0, 2), (0, 0), (1, 0), (1, 3), (2, 1), (2, 1)])
    assert runs == [[0, 2], [1, 3], [2, 2]]
    assert versions.expand(runs) == [0, 0, 1, 1, 1, 2, 2]
    assert versions.num_tokens(runs) == 7
    assert versions.encode([]) == [] and versions.expand([]) == []
