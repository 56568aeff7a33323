"""The cache-key rule for `copy_blocks`: its kept call's key covers every check a repeat skips.

A first call passes its checks and keeps its call (program, ids upload); a repeat that breaks
one check, everything else equal, is still refused with the documented error: each check of
both caches (type and structure, rank, block count, layers, block shape, dtype, memory kind,
devices, sharding, arrays shared between or within them, deletion), of the options (impl,
direction) and of the ids (lengths, range, uniqueness, element type, bucket). The negative
control keys without a field a check reads (a lying `reads` declaration): the bad repeat then
gets through.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxsync
from jaxsync._calls import TREE, CallCache, reads
from jaxsync.kv import KVLayout, _copy, copy_blocks


LAYERS = ("l0", "l1")
LAYOUT = KVLayout(kind="packed", num_blocks=9, block_size=4, num_kv_heads=2, head_dim=4,
                  dtype=jnp.float32)  # fmt: skip
IDS = ([0, 2], [1, 3])


def cache(seed, *, layout=LAYOUT, layers=LAYERS, memory="device", placement=None):
    out = layout.random(layers, jax.random.key(seed), placement=placement)
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(memory)), out)


def assert_kept(src, dst):
    """A repeat of `copy_blocks(src, dst, *IDS)` would take its kept call."""
    options = (None, "auto", None, True)  # direction, impl and the kernel switches
    assert _copy._KEPT.find_tree((src, dst), options, *IDS, None)[0] is not None


def kept(src, dst):
    """`dst` after two copies, the second a kept call."""
    for _ in range(2):
        dst = copy_blocks(src, dst, *IDS)
    assert_kept(src, dst)
    return dst


def _other(dst, change):
    return {name: change(x) for name, x in dst.items()}


def _mesh():
    return Mesh(np.array(jax.devices()[:2]), ("x",))


# name -> (repeat args from (src, dst): (src, dst, src_ids, dst_ids, options), error, match)
BREAKS = {
    "type: not a dict": (lambda s, d: (s, list(d.values()), *IDS, {}), TypeError, "dict"),
    "rank": (lambda s, d: (s, _other(d, lambda x: x.reshape(-1)), *IDS, {}), ValueError,
             "block dim"),
    "block count across layers": (
        lambda s, d: (s, {**d, "l1": d["l1"][:5]}, *IDS, {}), ValueError, "number of blocks"),
    "layer set": (lambda s, d: (s, {"l0": d["l0"], "l9": d["l1"]}, *IDS, {}), ValueError,
                  "different layers"),
    "block shape": (lambda s, d: (s, _other(d, lambda x: x[:, :1]), *IDS, {}), ValueError,
                    "block shape"),
    "dtype": (lambda s, d: (s, _other(d, lambda x: x.astype(jnp.bfloat16)), *IDS, {}),
              ValueError, "dtype"),
    "memory kind: pinned to pinned": (
        lambda s, d: (cache(7, memory="pinned_host"), cache(8, memory="pinned_host"), *IDS, {}),
        ValueError, "unsupported copy"),
    "memory kind: mixed": (
        lambda s, d: (s, {**d, "l1": jax.device_put(d["l1"], d["l1"].sharding.with_memory_kind(
            "pinned_host"))}, *IDS, {}), ValueError, "mixes memory kinds"),
    "devices": (lambda s, d: (s, _other(d, lambda x: jax.device_put(x, jax.devices()[1])), *IDS,
                              {}), ValueError, "different devices"),
    "dst holds one array twice": (lambda s, d: (s, {"l0": d["l0"], "l1": d["l0"]}, *IDS, {}),
                                  ValueError, "same array twice"),
    "src and dst share an array": (lambda s, d: (s, {"l0": s["l0"], "l1": d["l1"]}, *IDS, {}),
                                   ValueError, "share some but not all"),
    "impl": (lambda s, d: (s, d, *IDS, {"impl": "pallas"}), ValueError, "impl must be"),
    "direction: unknown": (lambda s, d: (s, d, *IDS, {"direction": "d2x"}), ValueError,
                           "unknown direction"),
    "direction: not the memory kinds'": (lambda s, d: (s, d, *IDS, {"direction": "h2d"}),
                                         ValueError, "memory kinds say"),
    "ids: lengths": (lambda s, d: (s, d, [0, 2], [1], {}), ValueError, "has 2 ids but"),
    "ids: range": (lambda s, d: (s, d, [0, 2], [1, 9], {}), ValueError, "must lie in"),
    "ids: range of a smaller cache": (
        lambda s, d: (s, _other(d, lambda x: x[:3]), *IDS, {}), ValueError, "must lie in"),
    "ids: unique": (lambda s, d: (s, d, [0, 2], [1, 1], {}), ValueError, "must be unique"),
    "ids: ints": (lambda s, d: (s, d, [0, 2.0], [1, 3], {}), TypeError, "ints"),
    "ids: bucket": (lambda s, d: (s, d, *IDS, {"buckets": (1,)}), ValueError, None),
}  # fmt: skip


@pytest.mark.parametrize("broken", sorted(BREAKS))
def test_a_kept_copy_does_not_skip_a_check_its_key_misses(broken):
    src = cache(0)
    dst = kept(src, cache(1))
    change, error, match = BREAKS[broken]
    s, d, s_ids, d_ids, options = change(src, dst)
    with pytest.raises(error, match=match):
        copy_blocks(s, d, s_ids, d_ids, **options)


def test_a_kept_copy_does_not_skip_the_sharding_check():
    mesh = _mesh()
    heads, rows = NamedSharding(mesh, P(None, "x")), NamedSharding(mesh, P(None, None, "x"))
    src = cache(0, placement=heads)
    dst = kept(src, cache(1, placement=heads))
    with pytest.raises(ValueError, match="sharded differently"):
        copy_blocks(src, _other(dst, lambda x: jax.device_put(x, rows)), *IDS)


def test_a_kept_copy_refuses_a_deleted_cache():
    src = cache(0)
    dst = kept(src, cache(1))
    stale, dst = dst, copy_blocks(src, dst, *IDS)  # `stale` donated
    with pytest.raises(ValueError, match="deleted"):
        copy_blocks(src, stale, *IDS)


def test_a_kept_copy_within_one_cache_is_not_served_to_two():
    one = cache(0)
    for _ in range(2):  # a copy within one cache, kept
        one = copy_blocks(one, one, *IDS)
    assert_kept(one, one)
    two = copy_blocks(one, cache(2), *IDS)  # the same shapes, two caches: another program
    np.testing.assert_array_equal(np.asarray(two["l0"])[IDS[1]], np.asarray(one["l0"])[IDS[0]])


def test_every_field_of_the_key_is_declared_by_a_check():
    fields = set(_copy._KEPT.fields) | set(_copy._KEPT.tree_fields)
    assert fields == {"type", "shape", "dtype", "sharding", "committed", *TREE}


def test_negative_control_a_key_that_omits_a_checked_field_lets_the_bad_repeat_through(
    monkeypatch,
):
    # The cache checks read the leaves' dtype; a key declared without it serves the call kept
    # for float32 caches to a bfloat16 source, which the checks refuse.
    lying = reads("type", "shape", "sharding", "committed", "live", *TREE, "metadata")
    monkeypatch.setattr(_copy, "_KEPT", CallCache(256, checks=[lying(lambda: None)]))
    monkeypatch.setattr(_copy, "_PROGRAMS", jaxsync.PlanCache(256))
    src = cache(0)
    dst = kept(src, cache(1))
    bf16 = _other(src, lambda x: x.astype(jnp.bfloat16))
    out = copy_blocks(bf16, dst, *IDS)  # not refused: the call kept for float32 ran
    assert out["l0"].dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(out["l0"])[IDS[1]], np.asarray(bf16["l0"], np.float32)[IDS[0]]
    )
    monkeypatch.undo()  # the honest key refuses the same repeat
    src = cache(0)
    dst = kept(src, cache(1))
    with pytest.raises(ValueError, match="dtype"):
        copy_blocks(_other(src, lambda x: x.astype(jnp.bfloat16)), dst, *IDS)


def test_a_tree_key_covers_structure_aliasing_and_options():
    a, b = jnp.zeros((2, 3)), jnp.zeros((2, 3))
    key = CallCache(checks=[reads("shape", *TREE)(lambda: None)]).tree_key
    base = key({"x": a, "y": b}, ("auto", None))
    assert base == key({"x": b, "y": a}, ("auto", None))  # other arrays, the same pattern
    others = [
        key({"x": a, "z": b}, ("auto", None)),  # structure
        key({"x": a, "y": a}, ("auto", None)),  # one array twice
        key({"x": a, "y": b[:1]}, ("auto", None)),  # a leaf's shape
        key({"x": a, "y": b}, ("xla", None)),  # an option's value
        key({"x": a, "y": b}, ("auto", 0)),  # an option's type
    ]
    assert len({base, *others}) == len(others) + 1
    assert key({"x": a}, (1,)) != key({"x": a}, (True,)) != key({"x": a}, (1.0,))
    # no key: host leaves, an option that is not a scalar
    assert key({"x": np.zeros(3)}) is None and key({"x": a}, ([1],)) is None
