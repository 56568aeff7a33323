"""A toy family added by docs/ARCHITECTURE.md's five steps ("Adding a family"), and proved.

Each step below is the doc's step of the same number, written as a newcomer would from the doc
alone: (1) a config and a tower whose repeated layers are one `jaxsync.LayerStack`; (2) a host
planner returning a typed plan; (3) a pure forward returning `jaxsync.Encoded`; (4) the entry
class on `jaxsync.TowerEncoder`; (5) the encoder's one input per bucket, for `jaxsync.precompile`
(a `jaxsync.Target`: the toy lives outside `jaxsync.models`).
Then: the entry equals a numpy reference at 1e-5 and the server form (`jaxsync.testing.
server_step`), a repeated bucket compiles nothing, bad input is refused on the host (nothing
uploaded or compiled) with the documented error, and `jaxsync.precompile` compiles it.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsync
from jaxsync import check, testing
from jaxsync._calls import reads
from jaxsync._encoder import expect
from jaxsync._entry import alive
from jaxsync._host import host_ints
from jaxsync._plans import content_key


# Step 1: a frozen config and the tower, its repeated layers in a LayerStack.
@dataclasses.dataclass(frozen=True)
class ToyConfig:
    in_dim: int = 6
    dim: int = 8
    num_layers: int = 3


class ToyLayer(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (dim, dim)) * 0.3)
        self.b = nnx.Param(jax.random.normal(rngs.params(), (dim,)) * 0.1)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(x @ self.w[...] + self.b[...][None, :])


class ToyTower(nnx.Module):
    def __init__(self, cfg: ToyConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.proj = nnx.Param(jax.random.normal(rngs.params(), (cfg.in_dim, cfg.dim)) * 0.4)
        self.layers = jaxsync.LayerStack(
            lambda r: ToyLayer(cfg.dim, rngs=r), cfg.num_layers, rngs=rngs
        )


# Step 2: the planner, numpy only: every static pad from buckets.
class ToyMeta(NamedTuple):
    item: np.ndarray  # int32 [T_bucket]: the item of each row; the items' count past the rows
    real: np.ndarray  # bool [I_bucket]: True for an item of the batch


class ToyPlan(NamedTuple):
    meta: ToyMeta
    lengths: tuple[int, ...]  # rows per item
    padded_rows: int  # the rows the input is padded to


def plan(lengths, cfg: ToyConfig, *, buckets=None) -> ToyPlan:
    lens = host_ints(lengths, name="lengths", minimum=1)  # TypeError / ValueError on the host
    if lens.size == 0:
        raise ValueError("lengths must name at least one item")
    rows, items = jaxsync.bucket(int(lens.sum()), buckets), jaxsync.bucket(lens.size, minimum=4)
    item = np.full(rows, items, np.int32)  # padding rows belong to no item
    item[: lens.sum()] = np.repeat(np.arange(lens.size, dtype=np.int32), lens)
    real = np.arange(items) < lens.size
    return ToyPlan(ToyMeta(item, real), tuple(int(n) for n in lens), rows)


# Step 3: the pure forward, callable inside any jit.
def forward(model: ToyTower, x: jax.Array, meta) -> jaxsync.Encoded:
    if x.shape[0] != meta.item.shape[0]:
        raise ValueError(f"x has {x.shape[0]} rows, the plan pads to {meta.item.shape[0]}")
    rows = model.layers(x @ model.proj[...])
    ok = (jnp.isfinite(rows).all(-1) & jnp.isfinite(x).all(-1)).astype(jnp.int32)
    per_item = jax.ops.segment_min(ok, meta.item, num_segments=meta.real.shape[0])
    return jaxsync.Encoded(rows, (per_item > 0) & meta.real)


# Step 4: the entry class on TowerEncoder: its checks, its planner, its call.
X = "x"


class ToyEncoder(jaxsync.TowerEncoder):
    def __init__(self, model: ToyTower, *, buckets=(8, 16, 32), placement=None,
                 plan_cache_size: int = 64, miss=None):  # fmt: skip
        expect(model, ToyTower)
        self.buckets = tuple(buckets)
        super().__init__(
            model,
            forward,
            name=X,
            checks=(alive(X), self._check_x),
            inside=X,
            placement=placement,
            fits=_padded,
            plan_cache_size=plan_cache_size,
            plan_of=self._planner,
            shape=lambda p: (p.padded_rows, model.cfg.in_dim),
            dtype=np.float32,
            miss=miss,
        )

    @reads("shape", "dtype")
    def _check_x(self, x) -> None:
        if x.ndim != 2 or x.shape[1] != self.cfg.in_dim:
            raise ValueError(f"x must be [T, {self.cfg.in_dim}], got {tuple(x.shape)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"x must be floating point, got {x.dtype}")

    def _planner(self, lengths):
        def planner(x, where):
            key, lens = content_key(lengths, lambda v: host_ints(v, name="lengths", minimum=1))
            return (key, where), lambda: plan(lens, self.cfg, buckets=self.buckets)

        return planner

    @check.entry_point
    def __call__(self, x, lengths) -> jaxsync.Embeddings:
        return self._entry(x, lengths)


@reads("shape", "metadata")
def _padded(x: jax.Array, p: ToyPlan) -> None:
    if x.shape[0] != p.padded_rows:
        raise ValueError(f"device x must be padded to {p.padded_rows} rows, got {x.shape[0]}")


# Step 5: the encoder's one input per bucket (host zeros of exactly that bucket).
def toy_target(enc: ToyEncoder) -> jaxsync.Target:
    return jaxsync.Target(
        "ToyEncoder",
        enc,
        make_inputs=lambda b: (np.zeros((b, enc.cfg.in_dim), np.float32), [b]),
        buckets=enc.buckets,
    )


# The proofs.
CFG = ToyConfig()


@pytest.fixture(scope="module")
def model() -> ToyTower:
    return ToyTower(CFG, rngs=nnx.Rngs(0))


def _reference(model: ToyTower, x: np.ndarray) -> np.ndarray:
    h = x.astype(np.float64) @ np.asarray(model.proj[...], np.float64)
    w, b = np.asarray(model.layers.layer.w[...]), np.asarray(model.layers.layer.b[...])
    for i in range(CFG.num_layers):
        h = h + np.tanh(h @ w[i].astype(np.float64) + b[i][None, :])
    return h


def _batch(lengths, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((sum(lengths), CFG.in_dim), np.float32)


def test_entry_equals_the_numpy_reference(model):
    lengths = [3, 1, 2]
    x = _batch(lengths)
    out = ToyEncoder(model)(x, lengths)
    assert out.lengths == (3, 1, 2) and out.offsets == (0, 3, 4)
    np.testing.assert_allclose(np.asarray(out.embeddings[:6]), _reference(model, x), rtol=1e-5)
    parts = out.split()
    np.testing.assert_allclose(np.asarray(parts[1]), _reference(model, x)[3:4], rtol=1e-5)
    assert np.asarray(out.extras["finite"])[:3].all()


def test_server_form_equals_the_entry(model):
    lengths = [4, 3]
    x = _batch(lengths, seed=1)
    enc = ToyEncoder(model)
    got = enc(x, lengths)
    p = plan(lengths, CFG, buckets=enc.buckets)
    padded = np.zeros((p.padded_rows, CFG.in_dim), np.float32)
    padded[: len(x)] = x
    step, leaves = testing.server_step(model, forward)
    served = jaxsync.Embeddings.of(step(leaves, padded, jaxsync.upload_packed(p)), p)
    np.testing.assert_array_equal(np.asarray(served.embeddings), np.asarray(got.embeddings))
    assert served.lengths == got.lengths
    testing.assert_layers_run(model, forward, padded, jaxsync.upload_packed(p))


def test_a_repeated_bucket_compiles_nothing(model):
    enc = ToyEncoder(model)
    enc(_batch([3, 2]), [3, 2])  # host rows: 5, bucket 8
    enc(jax.device_put(_batch([8], seed=3)), [8])  # device rows padded to bucket 8
    with check.no_recompile():
        enc(_batch([4, 3], seed=2), [4, 3])  # 7 rows, another plan: the same program
        device_x = jax.device_put(_batch([2, 6], seed=4))
        enc(device_x, [2, 6])
        enc(device_x, [2, 6])  # a kept call


def test_the_recompile_check_catches_a_new_bucket(model):  # negative control
    enc = ToyEncoder(model)
    enc(_batch([3, 2]), [3, 2])
    with pytest.raises(check.RecompileError), check.no_recompile():
        enc(_batch([9, 3]), [9, 3])  # 12 rows: bucket 16


@pytest.mark.parametrize(
    ("error", "match", "lengths", "x"),
    [
        (ValueError, "lengths", [3, -1], None),
        (TypeError, "lengths", [1.5, 2], None),
        (ValueError, "x must be", [3], np.zeros((3, CFG.in_dim + 1), np.float32)),
        (TypeError, "floating point", [3], np.zeros((3, CFG.in_dim), np.int32)),
        (ValueError, "x", [3], np.full((3, CFG.in_dim), np.nan, np.float32)),
    ],
)
def test_bad_input_is_refused_on_the_host(model, error, match, lengths, x):
    enc = ToyEncoder(model)
    x = _batch([3]) if x is None else x
    testing.assert_refused(error, match, enc, x, lengths)


def test_a_deleted_device_input_is_refused(model):
    enc = ToyEncoder(model)
    x = jax.device_put(_batch([8]))
    enc(x, [8])
    x.delete()
    with pytest.raises(ValueError, match="deleted"):
        enc(x, [8])


def test_precompile_compiles_every_bucket(model):
    enc = ToyEncoder(model)
    done = jaxsync.precompile([toy_target(enc)], progress=False)
    assert [(c.path, c.bucket) for c in done] == [("ToyEncoder", b) for b in enc.buckets]
    with check.no_recompile():
        enc(_batch([10, 6], seed=4), [10, 6])  # bucket 16
        enc(_batch([32], seed=5), [32])  # bucket 32


def test_the_refusal_check_fails_on_good_input(model):  # negative control
    with pytest.raises(pytest.fail.Exception):
        testing.assert_refused(ValueError, "x", ToyEncoder(model), _batch([3]), [3])


def test_from_pretrained_builds_through_the_family_loader(model):
    """`from_pretrained` passes the checkpoint, its config and the load options to the family's
    `load_model`, and the rest to the entry; a family without a loader is refused."""
    with pytest.raises(TypeError, match="ToyEncoder has no checkpoint loader"):
        ToyEncoder.from_pretrained("ckpt")
    seen = []

    class LoadedToy(ToyEncoder):
        @staticmethod
        def load_model(checkpoint, cfg=None, *, dtype=None, mesh=None, partition_rules="own"):
            seen.append((checkpoint, cfg, dtype, mesh, partition_rules))
            return model

    enc = LoadedToy.from_pretrained("ckpt", "cfg", dtype=jnp.bfloat16, buckets=(16,))
    assert isinstance(enc, LoadedToy) and enc.buckets == (16,) and enc.cfg is model.cfg
    LoadedToy.from_pretrained("ckpt", partition_rules=(("w", None),))
    assert seen == [("ckpt", "cfg", jnp.bfloat16, None, "own"), ("ckpt", None, None, None,
                    (("w", None),))]  # fmt: skip


class _WarnedPlan(ToyPlan):
    @property
    def warning(self) -> UserWarning:
        return UserWarning("this plan warns")


def test_a_plan_warning_is_emitted_outside_jaxsync_on_every_call(model, monkeypatch):
    """A plan with a `warning` has the core emit it on every call with it, at the first line
    outside jaxsync's packages (here the toy entry's own call into the core: the toy lives in
    this file): host input (a new plan, then a known one) and device input (the first call,
    then the kept call)."""
    original = globals()["plan"]
    monkeypatch.setitem(globals(), "plan", lambda *a, **k: _WarnedPlan(*original(*a, **k)))
    enc = ToyEncoder(model)
    body, first = inspect.getsourcelines(inspect.unwrap(ToyEncoder.__call__))
    host, device = _batch([3, 2]), jax.device_put(_batch([8], seed=3))
    for x, lengths in [(host, [3, 2]), (host, [3, 2]), (device, [8]), (device, [8])]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            enc(x, lengths)
        [w] = seen
        assert (str(w.message), w.filename) == ("this plan warns", __file__)
        assert first <= w.lineno < first + len(body)
    monkeypatch.setitem(globals(), "plan", original)  # control: a plan without one warns not
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ToyEncoder(model)(host, [3, 2])
    assert not seen


def test_a_family_miss_path_runs_for_every_call_the_cache_missed(model):
    """`miss=` replaces the default path of a missed call (`run` with `plan_of`): host input
    and a new signature of device input reach it; a repeated call runs the call it kept."""
    seen = []

    def miss(x, key, lengths):
        seen.append(type(x).__name__ if key is None else "device, keyed")
        return enc._entry.run(x, key, enc._planner(lengths))

    enc, want = ToyEncoder(model, miss=miss), ToyEncoder(model)
    x = _batch([5, 3])
    np.testing.assert_array_equal(np.asarray(enc(x, [5, 3]).embeddings),
                                  np.asarray(want(x, [5, 3]).embeddings))  # fmt: skip
    device_x = jax.device_put(x)
    enc(device_x, [5, 3])
    enc(device_x, [5, 3])  # kept: not a miss
    enc(x, [5, 3])  # host input is never kept
    assert seen == ["ndarray", "device, keyed", "ndarray"]
    enc(device_x, [3, 5])  # control: other metadata is another signature, a miss
    assert seen[-1] == "device, keyed" and len(seen) == 4
