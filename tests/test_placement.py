"""The placement rule every entry shares (`jaxsync._placement`): where host data and metadata go,
and which placements and device inputs are refused, naming both device sets."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from jaxsync._placement import batch_split, check_devices, devices_of, entry_placement


def _mesh(n: int = 8) -> jax.sharding.Mesh:
    return jax.make_mesh((n,), ("data",), (jax.sharding.AxisType.Auto,))


def test_devices_of_a_device_a_sharding_and_an_array():
    d0, d1 = jax.devices()[:2]
    assert devices_of(d0) == {d0}
    assert devices_of(SingleDeviceSharding(d1)) == {d1}
    assert devices_of(NamedSharding(_mesh(), P())) == set(jax.devices())
    assert devices_of(jax.device_put(jnp.ones(3), d1)) == {d1}


def test_check_devices_names_both_sets():
    d0, d1 = jax.devices()[:2]
    x = jax.device_put(jnp.ones(3), d1)
    check_devices(x, {d1}, "x")  # negative control: the same devices pass
    with pytest.raises(ValueError, match=r"^x on devices \[1\], but the weights on devices \[0\]"):
        check_devices(x, {d0}, "x")
    with pytest.raises(ValueError, match=r"placement \(.*\) on devices \[0\], but y= on devices"):
        check_devices(d0, set(jax.devices()), "placement", other="y=")


def test_check_devices_passes_a_traced_input():
    d0, d1 = jax.devices()[:2]
    seen = []

    @jax.jit
    def f(x):
        check_devices(x, {d0}, "x")  # a tracer's placement is the jit's
        seen.append(True)
        return x

    f(jax.device_put(jnp.ones(2), d1))
    assert seen == [True]


def test_entry_placement_defaults_beside_the_weights():
    d1 = jax.devices()[1]
    one = jax.device_put(jnp.ones(3), d1)
    assert devices_of(entry_placement(None, one)) == {d1}
    sharded = jax.device_put(jnp.ones(8), NamedSharding(_mesh(), P("data")))
    home = entry_placement(None, sharded)
    assert isinstance(home, NamedSharding) and home.spec == P()  # replicated over the mesh
    assert devices_of(home) == set(jax.devices())
    asked = NamedSharding(_mesh(), P("data"))
    assert entry_placement(asked, sharded) is asked  # the caller's, when on the weights' devices


def test_entry_placement_refuses_another_type_or_other_devices():
    d0, d1 = jax.devices()[:2]
    weights = jax.device_put(jnp.ones(3), d0)
    with pytest.raises(TypeError, match="placement must be a jax.Device, a Sharding or None"):
        entry_placement("cpu:0", weights)
    with pytest.raises(ValueError, match=r"placement .* on devices \[1\], but the weights"):
        entry_placement(d1, weights)
    assert entry_placement(d0, weights) is d0  # negative control


@pytest.mark.parametrize(
    ("spec", "want"), [(P(), 1), (P("data"), 8), (P("data", None), 8), (P(None), 1)]
)
def test_batch_split_counts_the_ways_dimension_0_is_split(spec, want):
    assert batch_split(NamedSharding(_mesh(), spec), "pixels") == want


def test_batch_split_refuses_a_split_off_the_batch_axis():
    mesh = jax.make_mesh((2, 4), ("data", "model"), (jax.sharding.AxisType.Auto,) * 2)
    assert batch_split(NamedSharding(mesh, P(("data", "model"))), "pixels") == 8
    with pytest.raises(ValueError, match="batch axis only"):
        batch_split(NamedSharding(mesh, P(None, "model")), "pixels")
    assert batch_split(None, "pixels") == batch_split(jax.devices()[0], "pixels") == 1
    assert batch_split(SingleDeviceSharding(jax.devices()[0]), "pixels") == 1
