"""Placement by partition rules on the simulated CPU devices: sharded loads compute what replicated
loads compute, and one rule table fits any mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

from jaxsync import weights
from jaxsync.testing import device_mesh
from jaxsync.weights import Rule, WeightError


D, F = 5, 24  # prime model dim; hidden dim divisible by 8, 4 and 2


class _Mlp(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.up = nnx.Linear(D, F, rngs=rngs)
        self.down = nnx.Linear(F, D, rngs=rngs)

    def __call__(self, x):  # [B, D] -> [B, D]
        return self.down(jax.nn.gelu(self.up(x)))


RULES = [
    Rule(r"(up|down)\.weight", r"\1.kernel", weights.linear),
    Rule(r"(up|down)\.bias", r"\1.bias"),
]
PARTITION = [
    (r"up\.kernel", (None, "model")),  # column-parallel
    (r"up\.bias", ("model",)),
    (r"down\.kernel", ("model", "data")),  # row-parallel; "data" is absent from 1-D meshes
    (r"down\.bias", ("model",)),  # 5 does not split: replicated
]


@pytest.fixture
def checkpoint(tmp_path):
    rng = np.random.default_rng(0)
    state = {
        "up.weight": rng.standard_normal((F, D)),
        "up.bias": rng.standard_normal(F),
        "down.weight": rng.standard_normal((D, F)),
        "down.bias": rng.standard_normal(D),
    }
    save_file({k: v.astype(np.float32) for k, v in state.items()}, tmp_path / "m.safetensors")
    return tmp_path / "m.safetensors"


def _specs(net):
    return {k: v.sharding.spec for k, v in _arrays(net).items()}


def _arrays(net):
    _, state = nnx.split(net, nnx.Param)
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}


def test_rule_table_shards_and_matches_replicated(checkpoint):
    mesh = device_mesh("model", auto=True)
    net = weights.load_weights(_Mlp, checkpoint, RULES, mesh=mesh, partition_rules=PARTITION)
    assert _specs(net) == {
        "up.kernel": P(None, "model"),
        "up.bias": P("model"),
        "down.kernel": P("model", None),
        "down.bias": P(None),
    }
    assert all(len(a.devices()) == mesh.size for a in _arrays(net).values())
    shard = _arrays(net)["up.kernel"].addressable_shards[0].data
    assert shard.shape == (D, F // mesh.size)  # really split, not replicated under a label

    ref = weights.load_weights(_Mlp, checkpoint, RULES)  # default device, unsharded
    assert all(len(a.devices()) == 1 for a in _arrays(ref).values())
    x = np.random.default_rng(1).standard_normal((3, D)).astype(np.float32)
    got = jax.jit(lambda m, x: m(x))(net, jnp.asarray(x))  # Auto axes: XLA propagates
    want = jax.jit(lambda m, x: m(x))(ref, jnp.asarray(x))
    # The row-parallel matmul sums partial products across devices: reordered fp32 sums.
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_same_table_on_a_2d_mesh(checkpoint):
    devices = jax.devices()
    if len(devices) < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=devices[:8])
    net = weights.load_weights(_Mlp, checkpoint, RULES, mesh=mesh, partition_rules=PARTITION)
    # down.kernel [F=24, D=5]: "model" splits 24, "data" (2) does not split 5: replicated.
    assert _specs(net)["down.kernel"] == P("model", None)
    assert _specs(net)["up.kernel"] == P(None, "model")


def test_no_rule_or_no_mesh_replicates(checkpoint):
    mesh = device_mesh("model", auto=True)
    net = weights.load_weights(_Mlp, checkpoint, RULES, mesh=mesh, partition_rules=[])
    assert set(_specs(net).values()) == {P()}
    assert all(len(a.devices()) == mesh.size for a in _arrays(net).values())
    net = weights.load_weights(_Mlp, checkpoint, RULES, partition_rules=PARTITION)
    assert all(len(a.devices()) == 1 for a in _arrays(net).values())


def test_partition_spec_fits_any_mesh():
    mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
    assert weights.partition_spec((None, "model"), (5, 24), mesh) == P(None, "model")
    assert weights.partition_spec(("model",), (7,), mesh) == P(None)  # 7 % 2: replicated
    assert weights.partition_spec((("data", "model"),), (6,), mesh) == P("model")
    assert weights.partition_spec(None, (6,), mesh) == P()
    with pytest.raises(WeightError, match="more entries than shape"):
        weights.partition_spec((None, "model"), (6,), mesh)


def test_rule_longer_than_parameter_names_it(checkpoint):
    mesh = device_mesh("model", auto=True)
    with pytest.raises(WeightError, match="parameter 'up.bias'"):
        weights.load_weights(
            _Mlp, checkpoint, RULES, mesh=mesh, partition_rules=[(r"up\.bias", (None, "model"))]
        )
