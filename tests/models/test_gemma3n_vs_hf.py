"""Gemma 3n audio path vs transformers through our loader (tower, embedder, padding, merge)."""

import dataclasses
import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsync.check
from jaxsync.harness.paths.gemma3n import reference as R
from jaxsync.models.gemma3n import (
    AudioTruncationWarning,
    Gemma3nAudioConfig,
    Gemma3nAudioEncoder,
    from_hf_config,
    load_model,
    merge_audio_embeddings,
)
from jaxsync.testing import rel_err, requires_torch


pytestmark = requires_torch

FP32_TOL = 1e-5
# bf16 has an 8-bit mantissa (ulp 2^-8 = 3.9e-3 relative); two independent bf16 pipelines through
# 2 conformer layers, softmax and three RMSNorms drift apart by tens of ulps. Measured worst case
# over these inputs: see test_bf16 (both ours and HF's own bf16 vs fp32 error are printed).
BF16_TOL = 6e-2
BUCKET = 64  # frames: every tiny-config clip below (<= 60 frames) shares one program per batch


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return R.build_reference(tmp_path_factory.mktemp("gemma3n"))


@pytest.fixture(scope="module")
def model(ref):
    return load_model(ref.checkpoint, ref.cfg)


@pytest.fixture(scope="module")
def embedder(ref, model):
    return Gemma3nAudioEncoder(model, frame_buckets=BUCKET)


def _noisy_padding(feats, mask, seed=1):
    """Non-zero features at padded frames: upstream passes them through, so must we."""
    noise = np.random.default_rng(seed).standard_normal(feats.shape).astype(np.float32)
    return np.where(mask[:, :, None], feats, noise)


@pytest.mark.parametrize("lengths", [[23, 9, 1], [57, 40, 13], [71, 70, 30]])
def test_tower_parity(ref, model, lengths):
    import torch

    feats, mask = R.mel_batch(lengths, max(lengths), ref.cfg.input_feat_size, seed=len(lengths))
    feats = _noisy_padding(feats, mask)
    with torch.no_grad():
        want = ref.tower(torch.from_numpy(feats), ~torch.from_numpy(mask), return_dict=True)
    enc, pad = jax.jit(lambda f, p: model.audio_tower(f, p))(feats, ~mask)
    assert np.array_equal(np.asarray(pad), want.audio_mel_mask.numpy())
    assert rel_err(enc, want.last_hidden_state.numpy()) <= FP32_TOL


@pytest.mark.parametrize("lengths,frames", [([23, 9, 1], 23), ([71, 70, 30], 71), ([5], 60)])
def test_encoder_only_rows_are_the_tower_encodings(ref, model, lengths, frames):
    """`embed=False`: each clip's rows are transformers' tower output for the batch (before the
    embedder), overflow or not, packed contiguously from row 0."""
    import torch

    enc = Gemma3nAudioEncoder(model, embed=False, frame_buckets=BUCKET)
    feats, mask = R.mel_batch(lengths, frames, ref.cfg.input_feat_size, seed=frames)
    feats = _noisy_padding(feats, mask)
    with torch.no_grad():
        want = ref.tower(torch.from_numpy(feats), ~torch.from_numpy(mask), return_dict=True)
    want = want.last_hidden_state.numpy()  # [B, T_a, D_a]
    out = enc(feats, mask)
    t_a = ref.cfg.num_tower_positions(frames)
    assert want.shape[1] == t_a and out.lengths == (t_a,) * len(lengths)
    assert out.offsets == tuple(range(0, t_a * len(lengths), t_a))
    assert out.rows.shape[1] == ref.cfg.hidden_size
    rows = np.asarray(out.rows)
    assert rel_err(rows[: out.num_tokens].reshape(want.shape), want) <= FP32_TOL
    assert not rows[out.num_tokens :].any()  # padding rows after the clips
    finite = np.asarray(out.finite)
    assert finite[: len(lengths)].all() and len(finite) >= len(lengths)


def test_embedder_parity(ref, model):
    import torch

    x = np.random.default_rng(3).standard_normal((2, 6, ref.cfg.hidden_size)).astype(np.float32)
    ids = np.arange(ref.cfg.audio_vocab_offset, ref.cfg.audio_vocab_offset + 7)[None, :]
    with torch.no_grad():
        soft = ref.embedder(inputs_embeds=torch.from_numpy(x)).numpy()
        hard = ref.embedder(input_ids=torch.from_numpy(ids)).numpy()
    assert rel_err(model.embed_audio.embed_soft(jnp.asarray(x)), soft) <= FP32_TOL
    assert rel_err(model.embed_audio.embed_ids(jnp.asarray(ids)), hard) <= FP32_TOL


# (lengths, frames): fewer than soft_tokens positions, exactly soft_tokens, a 1-frame clip.
PIPELINE_CASES = [([23, 9, 1], 23), ([57, 40, 13], 57), ([37, 37, 20], 60)]


@pytest.mark.parametrize("lengths,frames", PIPELINE_CASES)
def test_pipeline_parity(ref, embedder, lengths, frames):
    feats, mask = R.mel_batch(lengths, frames, ref.cfg.input_feat_size, seed=frames)
    feats = _noisy_padding(feats, mask)
    out = embedder(feats, mask)
    n, d = ref.cfg.soft_tokens, ref.cfg.text_hidden_size
    assert out.embeddings.shape == (4 * n, d) and out.lengths == (n,) * 3
    assert out.offsets == (0, n, 2 * n)
    assert rel_err(R.per_clip(out), R.reference_embed(ref, feats, mask)) <= FP32_TOL
    pad = np.asarray(embedder.pad_embedding())
    padding_clip = np.asarray(out.embeddings)[3 * n :]
    assert np.array_equal(padding_clip, np.broadcast_to(pad, padding_clip.shape))
    assert np.asarray(out.extras["finite"]).tolist() == [True] * 4  # 3 clips and a padding clip


def test_list_input_matches_vllm_batching(ref, embedder):
    feats, mask = R.mel_batch([30, 51], 51, ref.cfg.input_feat_size, seed=5)
    clips = [feats[0, :30], feats[1]]
    got = R.per_clip(embedder(clips))
    assert rel_err(got, R.reference_embed(ref, feats, mask)) <= FP32_TOL


@pytest.mark.parametrize("frames", [71, 80])
def test_overflow_error_like_transformers(ref, embedder, frames):
    n = ref.cfg.soft_tokens
    feats, mask = R.mel_batch([frames, 70, 30], frames, ref.cfg.input_feat_size, seed=7)
    extra = n - ref.cfg.num_tower_positions(frames)
    assert extra < 0
    if extra == -1:
        # torch's expand(-1) keeps the size-1 dim: transformers silently appends ONE padding
        # embedding (n + 2 positions) and only fails later in get_placeholder_mask's count check.
        assert R.reference_embed(ref, feats, mask).shape[1] == n + 2
    else:
        with pytest.raises(RuntimeError):  # "numel: integer multiplication overflow"
            R.reference_embed(ref, feats, mask)
    with pytest.raises(ValueError, match="soft_tokens"):
        embedder(feats, mask)


def test_overflow_truncate_like_vllm(ref, model):
    emb = Gemma3nAudioEncoder(model, overflow="truncate", frame_buckets=BUCKET)
    assert emb.cfg == dataclasses.replace(ref.cfg, overflow="truncate")
    feats, mask = R.mel_batch([71, 70, 30], 71, ref.cfg.input_feat_size, seed=7)
    with pytest.warns(AudioTruncationWarning, match=r"\{0: 1, 1: 1\}"):
        got = R.per_clip(emb(feats, mask))
    assert rel_err(got, R.reference_embed(ref, feats, mask, truncate=True)) <= FP32_TOL
    # the same through a model whose own config truncates
    truncating = load_model(ref.checkpoint, emb.cfg)
    with pytest.warns(AudioTruncationWarning, match=r"\{0: 1, 1: 1\}"):
        again = R.per_clip(Gemma3nAudioEncoder(truncating, frame_buckets=BUCKET)(feats, mask))
    np.testing.assert_array_equal(again, got)


def test_truncation_warns_at_the_callers_line_on_every_call(ref, model):
    """The warning names the caller's line on every call: host features (a new plan, then a
    known one) and device features (the first call, then the kept call); control: no
    truncation, no warning."""
    emb = Gemma3nAudioEncoder(model, overflow="truncate", frame_buckets=BUCKET)
    feats, mask = R.mel_batch([71, 70, 30], 71, ref.cfg.input_feat_size, seed=7)
    short, short_mask = R.mel_batch([40, 30], 40, ref.cfg.input_feat_size, seed=8)
    device = jnp.asarray(feats)
    for x, m, warns in [(feats, mask, 1), (feats, mask, 1), (device, mask, 1), (device, mask, 1),
                        (short, short_mask, 0)]:  # fmt: skip
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            line = inspect.currentframe().f_lineno + 1
            emb(x, m)
        ours = [w for w in seen if issubclass(w.category, AudioTruncationWarning)]
        assert [(w.filename, w.lineno) for w in ours] == [(__file__, line)] * warns


def test_bf16(ref):
    import torch

    model = load_model(ref.checkpoint, ref.cfg, dtype=jnp.bfloat16)
    emb = Gemma3nAudioEncoder(model, frame_buckets=BUCKET)
    feats, mask = R.mel_batch([57, 40, 13], 57, ref.cfg.input_feat_size, seed=57)
    out = emb(feats, mask)
    assert out.embeddings.dtype == jnp.bfloat16
    got = R.per_clip(out)
    want16 = R.reference_embed(ref, feats, mask, dtype=torch.bfloat16)
    want32 = R.reference_embed(ref, feats, mask)
    err, hf_err, ours_err = rel_err(got, want16), rel_err(want16, want32), rel_err(got, want32)
    print(f"bf16: ours vs HF bf16 {err:.2e}; vs fp32: HF {hf_err:.2e}, ours {ours_err:.2e}")
    assert err <= BF16_TOL
    assert ours_err <= max(2 * hf_err, BF16_TOL)  # not worse than HF's own bf16 rounding


def test_pad_embedding_cached_once(ref, embedder):
    import torch

    first = embedder.pad_embedding()
    assert embedder.pad_embedding() is first
    with torch.no_grad():
        want = ref.embedder(input_ids=torch.tensor([[ref.cfg.text_vocab_size - 1]])).numpy()
    assert rel_err(first, want[0, 0]) <= FP32_TOL


def _ids_with_placeholders(cfg: Gemma3nAudioConfig, starts, seq, rng):
    ids = rng.integers(0, 30, size=seq)
    for s in starts:
        ids[s : s + cfg.soft_tokens] = cfg.audio_token_id
    return ids


def test_merge_matches_masked_scatter(ref, embedder):
    import torch

    cfg = ref.cfg
    rng = np.random.default_rng(11)
    feats, mask = R.mel_batch([23, 9, 17], 23, cfg.input_feat_size, seed=11)
    audio = embedder(feats, mask)  # 4 clips' rows, rows of clip 3 are padding
    ids = np.stack(
        [_ids_with_placeholders(cfg, [2], 29, rng), _ids_with_placeholders(cfg, [1, 20], 29, rng)]
    )
    text = rng.standard_normal((2, 29, cfg.text_hidden_size)).astype(np.float32)
    got = merge_audio_embeddings(jnp.asarray(text), audio, ids, audio_token_id=cfg.audio_token_id)
    tmask = torch.from_numpy(ids == cfg.audio_token_id)[..., None].expand(*text.shape)
    want = torch.from_numpy(text).masked_scatter(tmask, torch.from_numpy(R.per_clip(audio)))
    assert np.array_equal(np.asarray(got), want.numpy())
    one_short = ids.copy()
    one_short[0, 2] = 0  # a placeholder fewer than the clips' rows
    with pytest.raises(ValueError, match="placeholder"):
        merge_audio_embeddings(
            jnp.asarray(text), audio, one_short, audio_token_id=cfg.audio_token_id
        )
    others = [(jnp.asarray(text), audio, np.roll(ids, k, axis=1)) for k in (3, 5)]
    jaxsync.check.assert_sync_free(
        merge_audio_embeddings,
        jnp.asarray(text),
        audio,
        ids,
        audio_token_id=cfg.audio_token_id,
        inputs=others,
    )


def test_config_from_object_dict_and_directory(ref, tmp_path):
    hf = R.hf_config()
    hf.save_pretrained(tmp_path)
    assert from_hf_config(hf) == ref.cfg
    assert from_hf_config(hf.to_dict()) == ref.cfg
    assert from_hf_config(tmp_path) == ref.cfg
    assert from_hf_config(tmp_path / "config.json") == ref.cfg
    assert Gemma3nAudioConfig.from_hf_config(str(tmp_path)) == ref.cfg


def test_config_rejects_unsupported(ref):
    hf = R.hf_config()
    hf.audio_config.conf_something_new = 3
    with pytest.raises(ValueError, match="conf_something_new"):
        from_hf_config(hf)
    with pytest.raises(ValueError, match="conf_something_new"):
        from_hf_config(hf.to_dict())
    with pytest.raises(ValueError, match="multiple"):
        dataclasses.replace(ref.cfg, conf_num_attention_heads=4)
    with pytest.raises(ValueError, match="overflow"):
        dataclasses.replace(ref.cfg, overflow="drop")


def test_configs_of_other_models_are_refused(ref):
    # another model's config in Gemma 3n's layout is refused by its model_type (the control:
    # the same dict without the name is read)
    d = R.hf_config().to_dict()
    assert from_hf_config({k: v for k, v in d.items() if k != "model_type"}) == ref.cfg
    with pytest.raises(ValueError, match="model_type 'gemma4'"):
        from_hf_config({**d, "model_type": "gemma4"})
    with pytest.raises(ValueError, match="model_type 'gemma4_audio'"):
        from_hf_config({**d, "audio_config": {**d["audio_config"], "model_type": "gemma4_audio"}})


def test_bench_rows_time_device_and_host_features_alike():
    # Each workload is timed on device features (next to transformers, whose inputs are on the
    # device too) and on host features (the upload included), each through the entry and the
    # server form: same clips, same embeddings.
    from jaxsync.harness import registry
    from jaxsync.testing import assert_same_math

    cases = registry.benches(["gemma3n"])["gemma3n"]("cpu", "tiny")
    kinds = ["device features]", "host features]"]
    kinds = [k for kind in kinds for k in (kind, f"{kind} · server form")]
    assert [c.name.rsplit(", ", 1)[1] for c in cases] == kinds * 2
    for on_device, device_server, on_host, host_server in zip(*[iter(cases)] * 4, strict=True):
        assert set(on_device.torch_fns) == {"transformers_eager"} and not on_host.torch_fns
        assert not device_server.torch_fns and not host_server.torch_fns
        a, b = on_device.jax_fn(), on_host.jax_fn()  # both rotate to the same batch
        assert a.lengths == b.lengths
        for x, y in zip(a.split(), b.split(), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        for server in (device_server, host_server):  # the entry's program on the same batch
            assert_same_math(server.jax_fn(), b.rows)
