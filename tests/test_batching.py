"""jaxsync._batching: device batches padded to their bucket, per-batch programs warmed per bucket;
and the hooks of `TowerEntry` / `jaxsync._encoder` an entry builds on.

A toy entry (`BucketEntry` over a one-weight tower) proves: a device batch smaller than its
bucket is padded on the device and gives the host batch's rows bit for bit, its repeat is one
kept call; a bucket's first call compiles the pads and slices of every batch size it holds; a
host input goes through `to_host`, and a `placement` function is asked only after the host
checks. Each proof has a negative control.
"""

from __future__ import annotations

import functools as ft
from operator import attrgetter
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxsync
from jaxsync._batching import BatchSplit, BucketEntry, Warmer, committed, pad_batch
from jaxsync._calls import reads
from jaxsync._entry import TowerEntry
from jaxsync._placement import replicated
from jaxsync.check import RecompileError, no_recompile


D = 4
BUCKETS = (1, 4, 8)


class Toy(nnx.Module):
    def __init__(self):
        self.cfg = None
        self.w = nnx.Param(jnp.arange(D * D, dtype=jnp.float32).reshape(D, D) / 10)


class ToyMeta(NamedTuple):
    valid: np.ndarray  # bool [rows]


class ToyPlan(NamedTuple):
    meta: ToyMeta
    lengths: tuple[int, ...]
    num_images: int
    rows: int


def plan(n: int) -> ToyPlan:
    rows = jaxsync.bucket(n, BUCKETS)
    return ToyPlan(ToyMeta(np.arange(rows) < n), (1,) * n, n, rows)


def forward(model: Toy, x: jax.Array, meta) -> jaxsync.Encoded:
    rows = x @ model.w[...]
    return jaxsync.Encoded(rows, jnp.isfinite(rows).all(-1), {"ids": jnp.arange(x.shape[0])})


@reads("shape", "dtype")
def _check(x) -> None:
    if x.ndim != 2 or x.shape[1] != D:
        raise ValueError(f"x must be [B, {D}], got {tuple(x.shape)}")


def _head(out: jaxsync.Encoded, n: int) -> jax.Array:
    return _slice(out.extras["ids"], n)


@ft.partial(jax.jit, static_argnums=1)
def _slice(ids: jax.Array, n: int) -> jax.Array:
    return ids[:n]


def _entry(sizes=None, each=None, **options):
    program = jaxsync.TowerProgram(Toy(), forward)
    warm = Warmer(sizes or _sizes, each or _head)
    return BucketEntry(program, name="x", checks=(_check,), batch=attrgetter("rows"),
                       output=lambda out, p: p.finish(out), warm=warm, **options)  # fmt: skip


def _sizes(rows: int, where) -> list[int]:
    return [n for n in range(1, rows + 1) if jaxsync.bucket(n, BUCKETS) == rows]


def _planner(x, where):
    n = x.shape[0]
    return (n, where), lambda: plan(n)


def _call(entry: TowerEntry, x, placement=None):
    run, key = entry.calls.find(x)
    if run is not None:
        return run(x)
    at = jax.devices()[0] if placement is None else placement
    return entry.run(x, key, _planner, placement=at, near=jaxsync.replicated_near,
                     shape=lambda p: (p.rows, D), dtype=np.float32)  # fmt: skip


def _end_padded(out: jax.Array, x: np.ndarray, rows: int) -> bool:
    out = np.asarray(out)
    return out.shape == (rows, D) and (out[: len(x)] == x).all() and not out[len(x) :].any()


def test_pad_batch_zero_pads_the_end_and_keeps_the_placement():
    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    split = NamedSharding(mesh, P("d"))
    x = np.arange(2 * D, dtype=np.float32).reshape(2, D) + 1
    out = pad_batch(split)(jax.device_put(x, split), 4)
    assert _end_padded(out, x, 4) and out.sharding == split
    assert pad_batch(split) is pad_batch(split)  # one program per placement


def test_the_pad_check_refuses_a_pad_at_the_front():  # negative control
    x = np.ones((2, D), np.float32)
    assert not _end_padded(jnp.pad(x, ((2, 0), (0, 0))), x, 4)


def test_committed_is_none_for_uncommitted_input():
    x = np.ones((2, D), np.float32)
    assert committed(jnp.asarray(x)) is None
    device = jax.devices()[1]
    assert committed(jax.device_put(x, device)).device_set == {device}


def test_a_short_device_batch_equals_the_host_batch_and_its_repeat_is_kept():
    entry = _entry()
    x = np.random.default_rng(0).normal(size=(3, D)).astype(np.float32)
    host = _call(entry, x)
    first = _call(entry, jax.device_put(x, jax.devices()[0]))
    assert first.embeddings.shape == (4, D) and first.lengths == (1, 1, 1)
    np.testing.assert_array_equal(np.asarray(first.embeddings), np.asarray(host.embeddings))
    again = jax.device_put(x, jax.devices()[0])
    run, _ = entry.calls.find(again)
    assert run is not None  # the pad and the program, kept
    np.testing.assert_array_equal(np.asarray(run(again).embeddings), np.asarray(host.embeddings))


def test_a_plain_entry_runs_a_short_batch_unpadded():  # negative control: the pad matters
    program = jaxsync.TowerProgram(Toy(), forward)
    entry = TowerEntry(program, name="x", checks=(_check,))
    out = _call(entry, jax.device_put(np.ones((3, D), np.float32), jax.devices()[0]))
    assert out.embeddings.shape == (3, D)


def _sizes_in_bucket_compile_nothing(entry: BucketEntry, first: int, then: int) -> None:
    device = jax.devices()[0]
    _call(entry, jax.device_put(np.ones((first, D), np.float32), device))  # the bucket's first
    with no_recompile():
        out = _call(entry, jax.device_put(np.ones((then, D), np.float32), device))
        _head(out, then)  # as an entry's own slice: the warmer compiled it for every size


def test_a_bucket_first_call_warms_every_batch_size():
    each = []
    entry = _entry(each=lambda out, n: (each.append(n), _head(out, n)))
    _sizes_in_bucket_compile_nothing(entry, 3, 2)
    assert each == [2, 3, 4]  # once per bucket, not again on the second call


def test_without_the_warm_up_a_new_batch_size_compiles():  # negative control (another bucket)
    with pytest.raises(RecompileError):
        _sizes_in_bucket_compile_nothing(_entry(sizes=lambda rows, where: []), 7, 5)


def test_host_input_goes_through_to_host_and_the_placement_function_after_the_checks():
    asked = []

    def placement():
        asked.append(True)
        return jax.devices()[0]

    entry = _entry(to_host=lambda x: np.asarray(x, np.float32) * 2)
    with pytest.raises(ValueError, match="x must be"):
        _call(entry, np.ones((3, D + 1)), placement)
    assert asked == []  # the host checks refused it first
    out = _call(entry, [[1.0] * D], placement)
    assert asked == [True]
    want = (np.full((1, D), 2.0, np.float32) @ np.asarray(Toy().w[...]))[0]
    np.testing.assert_allclose(np.asarray(out.embeddings)[0], want, rtol=1e-6)  # doubled


class _Ring:
    """A staging ring that records what `TowerEntry.staged` does with the family's buffer."""

    def __init__(self):
        self.released, self.uploaded = [], []

    def upload(self, buffer):
        self.uploaded.append(buffer)
        return jax.device_put(buffer, jax.devices()[0])

    def release(self, buffer):
        self.released.append(buffer)


def test_a_staged_buffer_is_uploaded_or_released_when_its_plan_fails(monkeypatch):
    ring = _Ring()
    monkeypatch.setattr(jaxsync, "default_staging", ring)
    entry, device = _entry(), jax.devices()[0]
    x = np.ones((4, D), np.float32)
    buffer = x.copy()

    def failing():
        raise ValueError("bad lengths")

    with pytest.raises(ValueError, match="bad lengths"):
        entry.staged(x, buffer, ("k", 1), failing, device, device)
    assert ring.released == [buffer] and ring.uploaded == []
    out = entry.staged(x, buffer, ("k", 2), lambda: plan(4), device, device)
    assert ring.released == [buffer] and ring.uploaded == [buffer]  # control: not released
    want = _call(entry, jax.device_put(x, device)).embeddings
    np.testing.assert_array_equal(np.asarray(out.embeddings), np.asarray(want))


def test_replicated_places_metadata_whole_over_the_mesh():
    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    split = NamedSharding(mesh, P("d"))
    whole = replicated(split, "device")
    assert whole.mesh == mesh and whole.is_fully_replicated and whole.memory_kind == "device"
    assert replicated(split) == NamedSharding(mesh, P())
    device = jax.devices()[0]
    assert replicated(device) is device
    assert not split.is_fully_replicated  # control: the check tells a split placement apart


def test_a_second_entry_shares_the_plans_and_its_program_takes_new_weights():
    model = Toy()
    enc = jaxsync.TowerEncoder(model, forward, name="x", checks=(_check,))
    other = enc._entry_over(jaxsync.TowerProgram(model, forward), name="y")
    apart = jaxsync.TowerProgram(model, forward)  # control: a program the encoder never saw
    assert other.plans is enc.plans and other.checks == enc._entry.checks and other.name == "y"
    assert type(other) is TowerEntry and other.program in enc._programs
    nnx.update(model, jax.tree.map(lambda w: w + 1, nnx.state(model)))
    enc.load_state(model)
    x = jnp.ones((1, D), jnp.float32)
    meta = jaxsync.upload_packed(plan(1))
    new, old = other.program(x, meta).rows, apart(x, meta).rows
    np.testing.assert_allclose(np.asarray(new), np.asarray(x @ model.w[...]), rtol=1e-6)
    assert not np.allclose(np.asarray(new), np.asarray(old))


def test_a_batch_split_counts_the_data_shards_and_keeps_valid_placements_only():
    mesh = jax.make_mesh(
        (4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
    )
    host_at = NamedSharding(mesh, P("data"))
    split = BatchSplit(host_at, "x")
    assert split(None) == (4, replicated(host_at, "device"))  # host input: at the placement
    x = jax.device_put(np.zeros((8, D), np.float32), NamedSharding(mesh, P(("data", "model"))))
    assert split(x)[0] == 8 and split.shards(x.sharding) == 8  # device input: where it lives
    one = jax.device_put(np.zeros((8, D), np.float32), jax.devices()[0])
    assert split(one) == (1, one.sharding) and split.shards(one.sharding) == 1
    off = jax.device_put(np.zeros((8, D), np.float32), NamedSharding(mesh, P(None, "model")))
    with pytest.raises(ValueError, match="batch axis only"):
        split.check(off)  # negative control: a split off dimension 0
    assert off.sharding not in split.known  # refused placements are not kept
    assert split.check.reads == {"sharding", "committed"}  # what a kept call's key covers


def test_a_bucket_entry_refuses_a_device_batch_split_off_the_batch_axis():
    mesh = jax.make_mesh((4,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,))
    entry = _entry()
    good = jax.device_put(np.ones((8, D), np.float32), jax.devices()[0])  # the weights' device
    off = jax.device_put(np.ones((8, D), np.float32), NamedSharding(mesh, P(None, "model")))
    want = np.ones((8, D), np.float32) @ np.asarray(Toy().w[...])
    np.testing.assert_allclose(np.asarray(_call(entry, good).embeddings), want, rtol=1e-6)
    with pytest.raises(ValueError, match="batch axis only"):
        _call(entry, off)
