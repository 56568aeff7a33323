"""Qwen3-Omni audio encoder vs transformers' `Qwen3OmniMoeAudioEncoder`: tiny random models,
weights through the production loader (`load_model`), fp32 and bf16 parity, empty audios,
padding invariance, sync-freedom, the pure forward in a server jit and the loader's key handling."""

import copy
import dataclasses
import json

import numpy as np
import pytest

from jaxsync.testing import (
    assert_close,
    assert_same_math,
    rel_err,
    requires_torch,
    server_step,
)


pytestmark = requires_torch

torch = pytest.importorskip("torch")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

import jaxsync  # noqa: E402
from jaxsync.check import assert_sync_free  # noqa: E402
from jaxsync.harness.paths.qwen3_omni import reference as ref, verify as ver  # noqa: E402
from jaxsync.models import qwen3_omni as q3  # noqa: E402
from jaxsync.weights import WeightError, to_numpy_state  # noqa: E402


CFG = ref.TINY


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = ref.build_hf_encoder(CFG)
    ckpt = ref.save_hf_encoder(
        model, tmp_path_factory.mktemp("qwen3_omni") / "model.safetensors", "thinker.audio_tower."
    )
    tower = q3.load_model(ckpt, CFG)
    return dict(model=model, ckpt=ckpt, tower=tower, enc=q3.Qwen3OmniAudioEncoder(tower))


def _run(enc, lens, seed, *, pad=True):
    x = ref.random_features(CFG, lens, seed=seed)
    dev = jaxsync.async_h2d(q3.pad_features(x, lens) if pad else x)
    return x, enc(dev, lens)


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("lens", ver.PARITY_MIXES, ids=str)
def test_fp32_parity(tiny, lens):
    x, out = _run(tiny["enc"], lens, seed=sum(lens))
    want = ref.reference_outputs(tiny["model"], x, lens)
    got = out.split()
    assert list(out.lengths) == [w.shape[0] for w in want]
    assert out.lengths == tuple(int(n) for n in q3.feat_extract_output_lengths(lens))
    for a, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_close(g, w, rtol=1e-5, err_msg=f"audio {a} of {lens}")
    assert_close(out.embeddings[: out.num_tokens], np.concatenate(want), rtol=1e-5)
    assert not np.asarray(out.embeddings[out.num_tokens :]).any(), "padding rows must be zero"


def test_entry_program_equals_the_server_form_in_a_server_jit(tiny):
    # The entry compiles the server form's own function over the same leaves: bitwise on
    # XLA:CPU (assert_same_math; 1e-5 relative on a GPU compiler).
    step, leaves = server_step(tiny["tower"], q3.forward)
    assert len(leaves) == 29 and tiny["enc"].program.num_state_args == 2  # packed: own + stack
    for x, lens in ver.padded_inputs(CFG, ver.PARITY_MIXES + ver.ONE_BUCKET_MIXES):
        out = tiny["enc"](x, lens)
        encoded = step(leaves, x, jaxsync.upload_packed(tiny["enc"].plan(x.shape, lens)))
        assert_same_math(out.rows, encoded.rows)
        np.testing.assert_array_equal(np.asarray(out.finite), np.asarray(encoded.finite))


def test_each_layer_matches_the_transformers_layer(tiny):
    # layer i of the stack (`layers.at(i)`, weights from checkpoint keys `layers.{i}.*`) on
    # three attention windows vs HF's layer i on the same tokens with their cu_seqlens
    rng = np.random.default_rng(5)
    lens = np.array([CFG.window_tokens, 9, 17], np.int32)  # valid tokens per window
    x = rng.standard_normal((3, CFG.window_tokens, CFG.d_model)).astype(np.float32)
    valid = np.arange(CFG.window_tokens)[None, :] < lens[:, None]
    tokens = torch.from_numpy(x[valid])
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    for i in range(CFG.encoder_layers):
        ours = np.asarray(tiny["tower"].layers.at(i)(jnp.asarray(x), jnp.asarray(lens)))
        with torch.no_grad():
            want = tiny["model"].layers[i](tokens, cu_seqlens=cu)[0].numpy()
        assert_close(ours[valid], want, rtol=1e-5, err_msg=f"layer {i}")


def test_upstream_batch_dependence_is_reproduced(tiny):
    # Upstream pads the conv batch to its longest chunk, so an audio's last tokens depend on the
    # other audios (here a 37-frame audio alone vs next to a 100-frame one). We reproduce both.
    lens = [1, 8, 37]
    x = ref.random_features(CFG, lens + [100], seed=3)
    alone = ref.reference_outputs(tiny["model"], x[:, :46], lens)[2]
    batched = ref.reference_outputs(tiny["model"], x, lens + [100])[2]
    assert rel_err(alone, batched) > 1e-4, "the quirk this test guards is gone upstream"
    enc = tiny["enc"]
    assert_close(enc(x[:, :46], lens).split()[2], alone, rtol=1e-5)
    assert_close(enc(x, lens + [100]).split()[2], batched, rtol=1e-5)


def test_padding_invariance(tiny):
    lens = ver.PARITY_MIXES[0]
    _, padded = _run(tiny["enc"], lens, seed=7)
    _, unpadded = _run(tiny["enc"], lens, seed=7, pad=False)
    np.testing.assert_array_equal(np.asarray(padded.embeddings), np.asarray(unpadded.embeddings))
    wide = q3.Qwen3OmniAudioEncoder(tiny["tower"], window_buckets=(16,))
    _, more_windows = _run(wide, lens, seed=7)
    assert more_windows.embeddings.shape[0] > padded.embeddings.shape[0]
    assert_close(
        more_windows.embeddings[: padded.num_tokens],
        padded.embeddings[: padded.num_tokens],
        rtol=1e-6,
    )


def test_bf16_parity(tiny):
    """bf16 weights and activations vs the fp32 reference.

    Tolerance 3e-2: bf16 keeps 8 mantissa bits (2^-8 = 3.9e-3 per rounding) and the error of two
    layers plus the conv stem and projections accumulates to a few roundings. We also require it
    to be no worse than 2x transformers' own bf16 run of the same weights.
    """
    lens = ver.PARITY_MIXES[0]
    x = ref.random_features(CFG, lens, seed=11)
    want = np.concatenate(ref.reference_outputs(tiny["model"], x, lens))
    enc = q3.Qwen3OmniAudioEncoder(q3.load_model(tiny["ckpt"], CFG, dtype=jnp.bfloat16))
    out = enc(jaxsync.async_h2d(q3.pad_features(x, lens)), lens)
    ours = rel_err(out.embeddings[: out.num_tokens], want)
    hf_bf16 = copy.deepcopy(tiny["model"]).to(torch.bfloat16)
    theirs = rel_err(np.concatenate(ref.reference_outputs(hf_bf16, x, lens)), want)
    print(f"bf16 rel err: jaxsync {ours:.2e}, transformers bf16 {theirs:.2e}")
    assert ours <= 3e-2
    assert ours <= 2 * theirs


# ---------------------------------------------------------------- sync-freedom


def test_sync_free_and_one_program_for_five_mixes(tiny):
    inputs = ver.padded_inputs(CFG, ver.ONE_BUCKET_MIXES)
    report = assert_sync_free(tiny["enc"], *inputs[0], inputs=inputs[1:])
    assert report.compiles == 0
    print(report)


# ---------------------------------------------------------------- config and weights


def test_config_from_hf_objects(tiny):
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeAudioEncoderConfig,
        Qwen3OmniMoeConfig,
    )

    assert q3.Qwen3OmniAudioConfig.from_hf_config(tiny["model"].config) == CFG
    assert q3.Qwen3OmniAudioConfig.from_hf_config(Qwen3OmniMoeConfig()) == q3.Qwen3OmniAudioConfig()
    with pytest.raises(ValueError, match="scale_embedding"):
        q3.Qwen3OmniAudioConfig.from_hf_config(Qwen3OmniMoeAudioEncoderConfig(scale_embedding=True))


def _state(model, prefix):
    return {prefix + k: v.numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("prefix", q3.PREFIXES)
def test_prefix_detection(tiny, tmp_path, prefix):
    path = tmp_path / "m.safetensors"
    save_file(_state(tiny["model"], prefix), str(path))
    assert q3.find_prefix(path) == prefix


def test_prefix_from_the_index_opens_no_other_shard(tiny, tmp_path):
    """A sharded checkpoint's prefix comes from its index: the language model's shard (garbage
    here) is never opened, while reading the whole checkpoint trips over it (the control)."""
    from jaxsync.weights import read_checkpoint

    save_file(_state(tiny["model"], "thinker.audio_tower."), str(tmp_path / "audio.safetensors"))
    (tmp_path / "lm.safetensors").write_bytes(b"not a safetensors file")
    weight_map = {k: "audio.safetensors" for k in _state(tiny["model"], "thinker.audio_tower.")}
    weight_map["thinker.model.embed_tokens.weight"] = "lm.safetensors"
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    assert q3.find_prefix(tmp_path) == "thinker.audio_tower."
    got = to_numpy_state(q3.load_model(tmp_path, CFG))
    assert all(np.array_equal(v, got[k]) for k, v in to_numpy_state(tiny["tower"]).items())
    with pytest.raises(WeightError, match="lm.safetensors"):
        list(read_checkpoint(index))


def test_loader_keys(tiny, tmp_path):
    model = tiny["model"]
    want = to_numpy_state(q3.load_model(tiny["ckpt"], CFG))
    # HF 5.x in-memory names, plus the (non-persistent) position buffer some exports carry
    state = _state(model, "thinker.model.audio_tower.")
    state["thinker.model.audio_tower.positional_embedding.positional_embedding"] = np.zeros((3, 3))
    state["thinker.model.language_model.embed.weight"] = np.zeros((3, 3))  # another module
    save_file(state, str(tmp_path / "a.safetensors"))
    got = to_numpy_state(q3.load_model(tmp_path / "a.safetensors", CFG))
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)

    missing = _state(model, "thinker.audio_tower.")
    del missing["thinker.audio_tower.layers.1.fc2.bias"]
    save_file(missing, str(tmp_path / "b.safetensors"))
    with pytest.raises(WeightError, match=r"'layers\.layer\.fc2\.bias'.*layers \[1\]"):
        q3.load_model(tmp_path / "b.safetensors", CFG)
    unknown = {
        **_state(model, "thinker.audio_tower."),
        "thinker.audio_tower.extra.w": np.ones(2, np.float32),
    }
    save_file(unknown, str(tmp_path / "c.safetensors"))
    with pytest.raises(WeightError, match="extra.w"):
        q3.load_model(tmp_path / "c.safetensors", CFG)
    twice = {**_state(model, "thinker.audio_tower."), **_state(model, "audio_tower.")}
    save_file(twice, str(tmp_path / "d.safetensors"))
    with pytest.raises(WeightError, match="one audio encoder"):
        q3.load_model(tmp_path / "d.safetensors", CFG)
    wrong = q3.Qwen3OmniAudioConfig(**{**dataclasses.asdict(CFG), "output_dim": 31})
    with pytest.raises(WeightError, match="shape"):
        q3.load_model(tiny["ckpt"], wrong)


# ---------------------------------------------------------------- verify / bench registration


def test_verify_parity_and_bench_smoke(tiny, monkeypatch):
    # verify's own tiny pair is built the same way; reuse ours to reuse its compiled programs
    monkeypatch.setattr(ver, "_tiny_pair", lambda: (tiny["model"], tiny["enc"]))
    parity = ver._parity()
    assert parity.ok, str(parity)
    from jaxsync.harness.paths.qwen3_omni import bench

    case, server = bench._bench("cpu", "tiny")
    assert server.name == f"{case.name} · server form" and not server.torch_fns
    ours = case.jax_fn()
    assert_same_math(server.jax_fn(), ours)  # each runner starts from the same input
    tokens = int(q3.feat_extract_output_lengths([130, 57, 410, 260]).sum())
    for fn in case.torch_fns.values():
        assert tuple(fn().shape) == (tokens, CFG.output_dim)
    assert ours.shape[1] == CFG.output_dim and ours.shape[0] >= tokens
    jax.block_until_ready(ours)


def test_load_model_reads_config_and_keeps_the_checkpoint_dtype(tiny, tmp_path):
    # cfg=None reads config.json next to the weights (a full checkpoint config: audio_config
    # under thinker_config); dtype=None keeps a bf16 checkpoint at bf16, dtype= casts.
    hf = ref.hf_config(CFG).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({"thinker_config": {"audio_config": hf}}))
    state = {k: v.to(torch.bfloat16) for k, v in tiny["model"].state_dict().items()}
    ref.save_hf_encoder_state(state, tmp_path / "model.safetensors", "thinker.audio_tower.")
    tower = q3.load_model(tmp_path)
    assert tower.cfg == CFG
    assert {x.dtype for x in jax.tree.leaves(nnx.state(tower))} == {jnp.dtype(jnp.bfloat16)}
    cast = q3.load_model(tmp_path, dtype=jnp.float32)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(cast))} == {jnp.dtype(jnp.float32)}
    assert q3.Qwen3OmniAudioConfig.from_hf_config(tmp_path) == CFG
    with pytest.raises(TypeError, match="float dtype"):
        q3.load_model(tmp_path, dtype=jnp.int32)


def test_audio_configs_of_other_models_are_refused():
    """Qwen2.5-Omni's audio encoder config shares the field names (at n_window 50 its values
    pass the field diff: the control) but downsamples otherwise; its model_type is refused."""
    import transformers

    other = transformers.Qwen2_5OmniAudioEncoderConfig(n_window=50).to_dict()
    unnamed = {k: v for k, v in other.items() if k != "model_type"}
    assert q3.Qwen3OmniAudioConfig.from_hf_config(unnamed).n_window == 50  # fields alone pass
    with pytest.raises(ValueError, match="model_type 'qwen2_5_omni_audio_encoder'"):
        q3.Qwen3OmniAudioConfig.from_hf_config(other)
    full = transformers.Qwen3OmniMoeConfig().to_dict()
    assert q3.Qwen3OmniAudioConfig.from_hf_config(full) == q3.Qwen3OmniAudioConfig.from_hf_config(
        full["thinker_config"]["audio_config"]
    )
    with pytest.raises(ValueError, match="model_type 'qwen2_5_omni'"):
        q3.Qwen3OmniAudioConfig.from_hf_config({**full, "model_type": "qwen2_5_omni"})
