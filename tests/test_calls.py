"""CallCache: a call's signature on device inputs, the kept call, refusal of deleted input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsync
from jaxsync._calls import CallCache, call_key, prepared_call


def test_call_key_is_the_whole_signature():
    x = jnp.zeros((4, 3), jnp.float32)
    key = call_key
    assert key(x, [1, 2]) == key(jnp.ones((4, 3), jnp.float32), [1, 2])
    others = [
        key(jnp.zeros((4, 5), jnp.float32), [1, 2]),  # shape
        key(x.astype(jnp.bfloat16), [1, 2]),  # dtype
        key(jax.device_put(x, jax.devices()[1]), [1, 2]),  # placement
        key(jax.device_put(x, jax.devices()[0]), [1, 2]),  # committed to its device
        key(x, [1, 3]),  # metadata content
        key(x, (1, 2)),  # metadata type
        key(x, None),  # metadata absent
    ]
    assert len({key(x, [1, 2]), *others}) == len(others) + 1
    # no signature: host data, traced arrays, metadata without an exact key
    assert key(np.zeros((4, 3)), [1]) is None and key(x, [True]) is None
    assert key(x, [1.0]) is None and key(x, np.zeros(2, object)) is None
    jax.jit(lambda t: key(t) is None or pytest.fail("a tracer got a signature"))(x)


def test_prepared_call_refuses_deleted_input_and_passes_other_errors():
    def boom(x):
        raise RuntimeError("not about deletion")

    x = jnp.ones(3)
    double = prepared_call(jax.jit(lambda a: 2 * a), "x")
    np.testing.assert_array_equal(np.asarray(double(x)), [2, 2, 2])
    with pytest.raises(RuntimeError, match="not about deletion"):
        prepared_call(boom, "x")(x)
    x.delete()
    with pytest.raises(ValueError, match="x was deleted"):
        double(x)
    # control: without the wrapper JAX's own RuntimeError is what the caller would see
    with pytest.raises(RuntimeError, match="deleted"):
        jax.jit(lambda a: 2 * a)(x)


def test_call_cache_keeps_at_most_maxsize_signatures():
    cache = CallCache(maxsize=2)
    arrays = [jnp.zeros(n) for n in (1, 2, 3)]
    for a in arrays:
        run, key = cache.find(a)
        assert run is None
        cache.keep(key, lambda x: x)
    assert len(cache) == 2 and cache.find(arrays[0])[0] is None
    assert cache.find(arrays[2])[0] is not None
    assert cache.keep(None, abs) is abs and len(cache) == 2  # no signature: nothing kept


def _tiny_program():
    class Scale(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.full((3,), 2.0))

    model = Scale()
    program = jaxsync.TowerProgram(model, lambda m, x, b: (m.w[...] * x + b, x.sum()))
    return model, program


def test_prepared_tower_call_reads_new_weights_and_refuses_deleted_input():
    model, program = _tiny_program()
    finish = jaxsync.Embeddings.assembler(((3,), (0,)), ("total",))
    run = program.prepared(jnp.ones(3), finish=finish, name="x")
    x = jnp.arange(3.0)
    out = run(x)
    np.testing.assert_array_equal(np.asarray(out.embeddings), [1, 3, 5])
    assert out.lengths == (3,) and out.offsets == (0,) and float(out.extras["total"]) == 3
    model.w[...] = jnp.full((3,), 10.0)
    program.load_state(model)
    np.testing.assert_array_equal(np.asarray(run(x).embeddings), [1, 11, 21])  # no stale weights
    x.delete()
    with pytest.raises(ValueError, match="x was deleted"):
        run(x)


def test_assembler_refuses_an_output_count_it_was_not_built_for():
    finish = jaxsync.Embeddings.assembler(((1,), (0,)), ("finite",))
    with pytest.raises(ValueError):
        finish((jnp.ones(1), jnp.ones(1), jnp.ones(1)))
