"""The server form of the Voxtral path: `forward(nnx.merge(graphdef, state), inputs, meta)` inside
a server's jit over the state's flat leaves. Its argument count, recompiles, equality with the
entry, the stacked layers, the plan contract and the trace-time shape checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsync
import jaxsync.check
import jaxsync.testing
from jaxsync.harness.paths.voxtral import reference as ref
from jaxsync.models.voxtral import (
    MelConfig,
    VoxtralAudioConfig,
    VoxtralAudioEncoder,
    VoxtralAudioTower,
    WaveformBuckets,
    forward,
    forward_waveforms,
    plan,
    plan_waveforms,
    server_form,
)


TINY = ref.TINY_ENCODER
LEAVES = 24  # conv 4, positions 1, one stacked layer 15, final norm 2, projector 2


def server_jit(model: nnx.Module, fn=forward):
    """A server's step: its state as flat leaves, the module rebuilt inside its jit."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(state)

    @jax.jit
    def step(leaves, x, meta):
        return fn(nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves)), x, meta)

    return step, leaves


def _features(c: int, cfg: VoxtralAudioConfig, seed: int = 0) -> jax.Array:
    return jax.device_put(ref.window_features(c, cfg, seed).astype(np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_state_leaves_are_the_jit_arguments_and_do_not_grow_with_depth(dtype):
    counts = []
    for depth in (1, 6):
        cfg = VoxtralAudioConfig(**{**TINY, "num_hidden_layers": depth})
        tower = VoxtralAudioTower(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
        step, leaves = server_jit(tower)
        meta = jaxsync.upload_packed(plan([1, 2], cfg))  # 3 windows -> bucket 4
        args = step.lower(leaves, _features(4, cfg), meta).args_info
        counts.append((len(leaves), len(jax.tree.leaves(args))))
    assert counts == [(LEAVES, LEAVES + 2)] * 2, counts  # + the features and the packed meta


def test_released_config_state_leaf_count():
    """At the released sizes (Voxtral-Mini's 32-layer Whisper encoder, built abstractly)."""
    cfg = VoxtralAudioConfig()
    assert (cfg.num_hidden_layers, cfg.hidden_size) == (32, 1280)
    abstract = nnx.eval_shape(lambda: VoxtralAudioTower(cfg, rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(abstract))
    assert len(leaves) == LEAVES <= 40
    assert abstract.layers.layer.fc1.kernel.shape == (32, 1280, 5120)


def test_a_new_state_is_used_without_a_recompile():
    tower = ref.tiny_tower()
    step, leaves = server_jit(tower)
    cfg = tower.cfg
    feats = _features(4, cfg, 1)
    meta = jaxsync.upload_packed(plan([1, 3], cfg))
    before = step(leaves, feats, meta).rows
    halved = [w * 0.5 for w in leaves]
    with jaxsync.check.no_recompile():
        after = step(halved, feats, meta).rows
        again = step(leaves, feats, meta).rows
    assert not np.allclose(after, before)
    np.testing.assert_array_equal(again, before)


@pytest.mark.parametrize("project", [True, False])
def test_entry_and_server_form_give_bit_identical_rows(project):
    """Features and raw audio: the entry's rows and finite flags are the server jit's, and its
    result is `Embeddings.of(encoded, plan)`."""
    tower = ref.tiny_tower(3)
    cfg = tower.cfg
    enc = VoxtralAudioEncoder(tower, MelConfig(), project=project)
    feats = _features(4, cfg, 2)
    planned = plan([2, 1, 1], cfg, buckets=(4,), project=project)
    step, leaves = server_jit(tower, server_form(project))
    encoded = step(leaves, feats, jaxsync.upload_packed(planned))
    got = enc(input_features=feats, num_chunks=[2, 1, 1])
    want = jaxsync.Embeddings.of(encoded, planned)
    assert got.lengths == want.lengths and got.offsets == want.offsets
    per = cfg.tokens_per_chunk if project else cfg.max_source_positions
    assert got.lengths == (2 * per, per, per)
    jaxsync.testing.assert_same_math(got.rows, want.rows)
    np.testing.assert_array_equal(got.finite, want.finite)

    lens = [7001, 300, 12800]
    x = jax.device_put(ref.padded_batch([ref.noisy_audio(n, i) for i, n in enumerate(lens)]))
    wplan = plan_waveforms(
        lens, cfg, enc.mel_config, buckets=WaveformBuckets(items=(3,), samples=(12800,)),
        project=project,
    )  # fmt: skip
    wstep, _ = server_jit(tower, server_form(project, wplan.mel))
    wencoded = wstep(leaves, x, jaxsync.upload_packed(wplan))
    got = enc(x, lens)
    assert got.lengths == wplan.lengths == (2 * per, per, 2 * per)
    jaxsync.testing.assert_same_math(got.rows, wencoded.rows)
    np.testing.assert_array_equal(got.finite, wencoded.finite)


def test_encoder_only_rows_are_the_whisper_hidden_states():
    tower = ref.tiny_tower(4)
    feats = _features(2, tower.cfg, 3)
    out = VoxtralAudioEncoder(tower, project=False)(input_features=feats)
    hidden = jax.jit(tower.encode)(feats)  # [C, P, D] last_hidden_state
    jaxsync.testing.assert_same_math(out.rows, hidden.reshape(-1, hidden.shape[-1]))
    projected = VoxtralAudioEncoder(tower)(input_features=feats)
    assert projected.rows.shape[0] * tower.cfg.frames_per_token == out.rows.shape[0]  # control
    with pytest.raises(TypeError, match="project must be a bool"):
        VoxtralAudioEncoder(tower, project="no")


def test_every_layer_reaches_the_rows():
    tower = ref.tiny_tower(5)
    cfg = tower.cfg
    meta = jaxsync.upload_packed(plan([2], cfg))
    jaxsync.testing.assert_layers_run(tower, forward, _features(2, cfg), meta)
    lens = [7001, 300]
    x = jax.device_put(ref.padded_batch([ref.noisy_audio(n, i) for i, n in enumerate(lens)]))
    wplan = plan_waveforms(lens, cfg, MelConfig(), buckets=WaveformBuckets(items=(2,)))
    x = jnp.pad(x, ((0, 0), (0, wplan.width - x.shape[1])))
    jaxsync.testing.assert_layers_run(
        tower, server_form(True, wplan.mel), x, jaxsync.upload_packed(wplan)
    )


def test_per_layer_views_compose_to_the_stack():
    """`layers.at(i)` is layer i: running the views one by one gives the stack's scan."""
    tower = ref.tiny_tower(6, num_hidden_layers=3)
    x = jax.jit(tower.embed)(_features(2, tower.cfg, 4))
    views = [tower.layers.at(i) for i in range(3)]
    unrolled = jax.jit(lambda x: views[2](views[1](views[0](x))))(x)
    jaxsync.testing.assert_same_math(jax.jit(lambda x: tower.layers(x))(x), unrolled)
    skipped = jax.jit(lambda x: views[2](views[0](x)))(x)
    assert not np.allclose(skipped, unrolled)  # control: each view is its own layer


def test_two_and_three_audios_share_one_program():
    """The waveform planner picks the audio pad from buckets too (1 to 4 audios: 4 rows)."""
    cfg = VoxtralAudioConfig(**TINY)
    shapes = []
    for lens in ([7001, 300], [7001, 300, 5000]):  # 3 and 4 windows -> bucket 4
        p = plan_waveforms(lens, cfg, MelConfig())
        shapes.append((p.items, p.width, p.chunks, jax.tree.map(np.shape, p.meta)))
    assert shapes[0] == shapes[1] and shapes[0][:3] == (4, 10240, 4)
    five = plan_waveforms([300] * 5, cfg, MelConfig())
    assert five.items == 8  # control


def test_inputs_that_do_not_fit_the_plan_fail_while_tracing():
    tower = ref.tiny_tower()
    cfg = tower.cfg
    meta = plan([1, 2], cfg).meta  # 4 windows
    with pytest.raises(ValueError, match=r"features \(3, 128, 40\) do not fit the plan: it has 4"):
        jax.eval_shape(lambda x: forward(tower, x, meta), jnp.zeros((3, 128, 40)))
    with pytest.raises(ValueError, match=r"\(4, 128, 30\) do not fit the plan.*\[4, 128, 40\]"):
        jax.eval_shape(lambda x: forward(tower, x, meta), jnp.zeros((4, 128, 30)))
    wplan = plan_waveforms([7001, 300], cfg, MelConfig())
    with pytest.raises(ValueError, match=r"waveforms \(2, 10240\) do not fit the plan: it has 4"):
        jax.eval_shape(
            lambda x: forward_waveforms(tower, x, wplan.meta, mel=wplan.mel),
            jnp.zeros((2, 10240)),
        )
    fits = jax.eval_shape(
        lambda x: forward_waveforms(tower, x, wplan.meta, mel=wplan.mel), jnp.zeros((4, 2048))
    )
    assert fits.rows.shape == (4 * cfg.tokens_per_chunk, cfg.text_hidden_size)


def test_encoders_of_one_structure_share_their_programs():
    """An encoder rebuilt from a server's `(graphdef, state)` compiles nothing new: features,
    raw audio (the front end's settings bound to `forward_waveforms`) and hidden states."""
    tower = ref.tiny_tower(7)
    feats = _features(2, tower.cfg, 5)
    x = jax.device_put(ref.padded_batch([ref.noisy_audio(7001, 0), ref.noisy_audio(300, 1)]))

    def run(model):
        hidden = VoxtralAudioEncoder(model, project=False)
        return (
            VoxtralAudioEncoder(model)(input_features=feats).rows,
            VoxtralAudioEncoder(model)(x, [7001, 300]).rows,
            hidden(input_features=feats).rows,
            hidden(x, [7001, 300]).rows,
        )

    first = run(tower)
    graphdef, state = nnx.split(tower)
    with jaxsync.check.no_recompile():
        again = run(nnx.merge(graphdef, state))
    for a, b in zip(again, first, strict=True):
        np.testing.assert_array_equal(a, b)
