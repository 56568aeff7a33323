"""Qwen3-Omni audio encoder entry without torch models: the host planner against upstream's
formulas (written out here independently), config validation, bad input, plan caching and the
`jaxsync verify` registration. Serving behaviour lives in test_qwen3_omni_serving.py."""

import jax
import numpy as np
import pytest
from flax import nnx

import jaxsync
import jaxsync.testing
from jaxsync.harness.paths.qwen3_omni import reference as ref
from jaxsync.models import qwen3_omni as q3


# ---------------------------------------------------------------- upstream formulas


def upstream_output_len(lens):
    """`_get_feat_extract_output_lengths`: (L // 100) * 13 + three floor-division halvings."""
    lens = np.asarray(lens, np.int64)
    leave = lens % 100
    feat = (leave - 1) // 2 + 1
    return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (lens // 100) * 13


def upstream_plan(lens, n_window_infer):
    """HF `chunk_and_pad_features` + `get_audio_cu_seqlens` in numpy, for non-empty audios."""
    lens = np.asarray(lens, np.int64)
    assert (lens > 0).all(), "upstream mis-plans empty audios; compare without them"
    chunk_num = np.ceil(lens / 100).astype(np.int64)
    chunk_lengths = np.full(int(chunk_num.sum()), 100, np.int64)
    tail = np.cumsum(np.concatenate([[-1], chunk_num]))[1:]
    chunk_lengths[tail] = lens % 100
    chunk_lengths[chunk_lengths == 0] = 100
    cnn = upstream_output_len(chunk_lengths)
    aftercnn = upstream_output_len(lens)
    window = int(cnn.max()) * (n_window_infer // 100)
    cu = [0]
    for n in aftercnn:
        cu += [window] * int(n // window)
        if n % window:
            cu.append(int(n % window))
    return chunk_num, chunk_lengths, cnn, aftercnn, np.cumsum(cu)


def plan_cu_seqlens(plan):
    return np.concatenate([[0], np.cumsum(plan.meta.window_lens[: plan.num_windows])])


CONFIGS = {"tiny_ratio2": ref.TINY, "released_ratio8": ref.RELEASED}


# ---------------------------------------------------------------- planner


@pytest.mark.parametrize("name", list(CONFIGS))
def test_planner_matches_upstream_all_lengths_one_batch(name):
    cfg = CONFIGS[name]
    lens = np.random.default_rng(0).permutation(np.arange(1, 2001))
    plan = q3.plan(lens, cfg)
    num, chunk_lens, cnn, after, cu = upstream_plan(lens, cfg.n_window_infer)
    np.testing.assert_array_equal(plan.chunk_counts, num)
    np.testing.assert_array_equal(plan.chunk_lens, chunk_lens)
    np.testing.assert_array_equal(plan.chunk_tokens, cnn)
    assert plan.lengths == tuple(after.tolist())
    assert all(type(n) is int for n in plan.lengths)  # host ints: no numpy slice bounds
    np.testing.assert_array_equal(plan.chunk_starts, np.cumsum(chunk_lens) - chunk_lens)
    np.testing.assert_array_equal(plan_cu_seqlens(plan), cu)
    np.testing.assert_array_equal(plan.meta.item_rows[: lens.size], after)
    assert plan.item_bucket == 2048 and not plan.meta.item_rows[lens.size :].any()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_planner_matches_upstream_every_length_alone(name):
    # Alone, a short audio makes upstream's window shrink (max chunk tokens < 13): covered here.
    cfg = CONFIGS[name]
    np.testing.assert_array_equal(
        q3.feat_extract_output_lengths(np.arange(2001)), upstream_output_len(np.arange(2001))
    )
    for n in range(2001):
        plan = q3.plan([n], cfg)
        assert plan.lengths == (int(upstream_output_len(n)),)
        if n == 0:
            assert plan.chunk_lens.size == 0 and plan.num_windows == 0 and plan.num_tokens == 0
            continue
        num, chunk_lens, cnn, _, cu = upstream_plan([n], cfg.n_window_infer)
        np.testing.assert_array_equal(plan.chunk_lens, chunk_lens)
        np.testing.assert_array_equal(plan.chunk_tokens, cnn)
        np.testing.assert_array_equal(plan_cu_seqlens(plan), cu)
        # upstream pads the conv batch to its longest chunk; the plan records that length's
        # first two conv stages
        longest = int(chunk_lens.max())
        assert plan.meta.conv_limits.tolist() == [(longest + 1) // 2, ((longest + 1) // 2 + 1) // 2]


def _simulate_device(plan, cfg):
    """The device program's index arithmetic, on host labels instead of features."""
    meta = plan.meta
    frames = np.arange(plan.num_frames)
    offs = np.arange(cfg.chunk_len)
    valid = offs[None, :] < meta.slot_lens[:, None]
    gathered = np.where(valid, meta.slot_starts[:, None] + offs[None, :], -1)  # [S, 100]
    token_label = np.full((meta.slot_lens.size, 13), -1)
    for s in range(meta.slot_lens.size):  # label = (global chunk id, token) as one int
        token_label[s, : plan.slot_tokens[s]] = s * 13 + np.arange(plan.slot_tokens[s])
    flat = token_label.reshape(-1)
    out = np.where(meta.out_src < flat.size, flat[np.minimum(meta.out_src, flat.size - 1)], -2)
    return frames, gathered, out


@pytest.mark.parametrize("seed", range(40))
def test_planner_random_batches_with_empty_audios(seed):
    rng = np.random.default_rng(seed)
    cfg = ref.TINY if seed % 2 else ref.RELEASED
    n = int(rng.integers(1, 12))
    lens = rng.integers(0, 1300, n) * (rng.random(n) > 0.25)
    plan = q3.plan(lens, cfg)
    tokens = np.asarray(plan.lengths, np.int64)
    nonzero = lens[lens > 0]
    if nonzero.size:
        num, chunk_lens, cnn, after, cu = upstream_plan(nonzero, cfg.n_window_infer)
        np.testing.assert_array_equal(plan.chunk_lens, chunk_lens)
        np.testing.assert_array_equal(tokens[lens > 0], after)
        np.testing.assert_array_equal(plan_cu_seqlens(plan), cu)
        # empty audios change only the item numbering: the frames, windows and rows the device
        # reads are those of the batch without them
        bare = q3.plan(nonzero, cfg)
        per_item = ("window_items", "item_rows")
        for k, v in plan.meta._asdict().items():
            if k not in per_item:
                np.testing.assert_array_equal(v, getattr(bare.meta, k), err_msg=k)
        real = plan.num_windows
        np.testing.assert_array_equal(
            plan.meta.window_items[:real], np.flatnonzero(lens > 0)[bare.meta.window_items[:real]]
        )
    assert (tokens[lens == 0] == 0).all()
    # per-item metadata: item i's windows and rows; padding windows name the item bucket
    items = np.repeat(np.arange(lens.size), plan.window_counts)
    np.testing.assert_array_equal(plan.meta.window_items[: plan.num_windows], items)
    assert (plan.meta.window_items[plan.num_windows :] == plan.item_bucket).all()
    np.testing.assert_array_equal(plan.meta.item_rows[: lens.size], tokens)
    assert not plan.meta.item_rows[lens.size :].any()

    # Every slot gathers exactly its chunk's frames; every output row is the right token.
    _, gathered, out = _simulate_device(plan, cfg)
    for c, slot in enumerate(plan.chunk_slots):
        want = plan.chunk_starts[c] + np.arange(plan.chunk_lens[c])
        np.testing.assert_array_equal(gathered[slot, : plan.chunk_lens[c]], want)
        assert (gathered[slot, plan.chunk_lens[c] :] == -1).all()
    expected = np.concatenate(
        [s * 13 + np.arange(t) for s, t in zip(plan.chunk_slots, plan.chunk_tokens, strict=True)]
        or [np.zeros(0, np.int64)]
    )
    np.testing.assert_array_equal(out[: plan.num_tokens], expected)
    assert (out[plan.num_tokens :] == -2).all()
    # a window holds chunks of one audio only, and its valid tokens are a prefix
    per_win = cfg.chunks_per_window
    audio_of_chunk = np.repeat(np.arange(lens.size), plan.chunk_counts)
    for w in range(plan.window_bucket):
        in_w = (plan.chunk_slots // per_win) == w
        assert len(set(audio_of_chunk[in_w].tolist())) <= 1
        assert set(audio_of_chunk[in_w].tolist()) <= {plan.meta.window_items[w]}
        toks = plan.slot_tokens[w * per_win : (w + 1) * per_win]
        valid = (np.arange(13)[None, :] < toks[:, None]).reshape(-1)
        assert valid.sum() == plan.meta.window_lens[w]
        assert valid[: plan.meta.window_lens[w]].all()


def test_buckets_share_programs():
    plans = [q3.plan(m, ref.TINY) for m in _verify().ONE_BUCKET_MIXES]
    assert len({(p.num_frames, p.window_bucket, p.item_bucket) for p in plans}) == 1
    assert plans[0].num_frames == q3.frame_bucket(int(plans[0].feature_lens.sum()))

    def shapes(p):
        return tuple((k, v.shape, v.dtype) for k, v in p.meta._asdict().items())

    assert len({shapes(p) for p in plans}) == 1
    # the item count is padded too: 2 and 3 audios (of one frame bucket) share every shape
    assert shapes(q3.plan([400, 100], ref.TINY)) == shapes(q3.plan([200, 200, 100], ref.TINY))
    # at most 25% padding beyond 8 windows / 128 frames
    for n in range(9, 5000):
        assert jaxsync.bucket(n, q3.WINDOW_BUCKETS) <= 1.25 * n
    for n in range(129, 20000, 7):
        assert q3.frame_bucket(n) <= 1.25 * n


# ---------------------------------------------------------------- config


def test_config_validation():
    assert ref.RELEASED.window_tokens == 104 and ref.RELEASED.conv_freq_bins == 16
    assert ref.TINY.conv_freq_bins == 3 and ref.TINY.window_tokens == 26
    with pytest.raises(ValueError, match="13 tokens"):
        q3.Qwen3OmniAudioConfig(n_window=60)
    with pytest.raises(ValueError, match="n_window_infer"):
        q3.Qwen3OmniAudioConfig(n_window_infer=99)
    with pytest.raises(ValueError, match="divisible"):
        q3.Qwen3OmniAudioConfig(d_model=100, encoder_attention_heads=3)
    with pytest.raises(ValueError, match="activation_function"):
        q3.Qwen3OmniAudioConfig(activation_function="mish")


def test_from_hf_config_dict_is_strict():
    base = {"d_model": 64, "encoder_attention_heads": 4, "output_dim": 2048, "dropout": 0.1}
    cfg = q3.Qwen3OmniAudioConfig.from_hf_config({"thinker_config": {"audio_config": base}})
    assert cfg.d_model == 64 and cfg.output_dim == 2048 and cfg.n_window_infer == 800
    with pytest.raises(ValueError, match="scale_embedding"):
        q3.Qwen3OmniAudioConfig.from_hf_config({**base, "scale_embedding": True})
    with pytest.raises(ValueError, match="use_flash"):
        q3.Qwen3OmniAudioConfig.from_hf_config({**base, "use_flash": True})


# ---------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def random_encoder():
    return q3.Qwen3OmniAudioEncoder(q3.Qwen3OmniAudioTower(ref.TINY, rngs=nnx.Rngs(0)))


BAD_CASES = (
    "negative length",
    "sum too large",
    "sum too small",
    "padding not the bucket",
    "wrong mel bins",
    "features 1-D",
    "lengths 2-D",
    "float lengths",
    "device lengths",
)


def _bad_case(name):
    f = ref.random_features(ref.TINY, [120, 30])
    return {
        "negative length": (f, [151, -1], ValueError, ">= 0"),
        "sum too large": (f, [120, 31], ValueError, "sum to 151 frames but the features have 150"),
        "sum too small": (f, [120, 29], ValueError, "sum to 149 frames"),
        "padding not the bucket": (np.zeros((22, 151), np.float32), [120, 30], ValueError, "160"),
        "wrong mel bins": (np.zeros((128, 150), np.float32), [120, 30], ValueError, "mel bins"),
        "features 1-D": (np.zeros(150, np.float32), [150], ValueError, "num_mel_bins, frames"),
        "lengths 2-D": (f, [[120, 30]], ValueError, "rank 1"),
        "float lengths": (f, [120.0, 30.0], TypeError, "integers"),
        "device lengths": (f, jax.numpy.array([120, 30]), TypeError, "host data"),
    }[name]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_raises_before_any_upload(random_encoder, case, monkeypatch):
    features, lens, exc, match = _bad_case(case)

    def no_upload(*a, **k):
        raise AssertionError("uploaded before validating")

    monkeypatch.setattr(jaxsync, "upload_packed", no_upload)
    monkeypatch.setattr(jaxsync, "async_h2d", no_upload)
    jaxsync.testing.watch_uploads(monkeypatch, no_upload)  # staged uploads too
    with pytest.raises(exc, match=match):
        random_encoder(features, lens)


def test_empty_batch_and_all_empty_audios(random_encoder):
    enc = random_encoder
    for lens in ([], [0, 0, 0]):
        out = enc(np.zeros((22, 0), np.float32), lens)
        assert out.lengths == tuple(0 for _ in lens) and out.num_tokens == 0
        assert not np.asarray(out.embeddings).any()
        assert [s.shape[0] for s in out.split()] == [0] * len(lens)
        assert np.asarray(out.finite).shape == (16,) and np.asarray(out.finite).all()


# ---------------------------------------------------------------- registration


def _verify():
    from jaxsync.harness.paths.qwen3_omni import verify

    return verify


def test_registered_for_verify():
    _verify()
    from jaxsync.harness import registry

    spec = next(s for s in registry._paths.values() if s.name == "qwen3_omni.audio_encoder")
    case = spec.build(None)
    assert len(case.inputs) >= 5 and callable(case.parity)
    assert "qwen3_omni" in registry._benches


def _count_uploads(monkeypatch):
    uploads = []
    real = jaxsync.upload_packed
    monkeypatch.setattr(
        jaxsync, "upload_packed", lambda *a, **k: uploads.append(1) or real(*a, **k)
    )
    return uploads


def test_repeated_length_mix_reuses_plan_and_upload(monkeypatch):
    enc = q3.Qwen3OmniAudioEncoder(q3.Qwen3OmniAudioTower(ref.TINY, rngs=nnx.Rngs(0)))
    f = ref.random_features(ref.TINY, [120, 30])
    first = np.asarray(enc(f, [120, 30]).embeddings)
    uploads = _count_uploads(monkeypatch)
    again = enc(f, np.array([120, 30], np.int32))  # same mix, other host container: a hit
    np.testing.assert_array_equal(np.asarray(again.embeddings), first)
    assert uploads == []
    enc(f, [30, 120])  # another mix: planned and uploaded
    assert uploads == [1]
    with pytest.raises(TypeError, match="integers"):  # cached ints do not admit floats
        enc(f, [120.0, 30.0])
    g = ref.random_features(ref.TINY, [1, 1])
    enc(g, [1, 1])
    with pytest.raises(TypeError, match="integers"):  # ... nor bools (True == 1, same hash)
        enc(g, [True, 1])
    assert len(enc.plans) == 3


def test_plan_cache_is_bounded(monkeypatch):
    enc = q3.Qwen3OmniAudioEncoder(
        q3.Qwen3OmniAudioTower(ref.TINY, rngs=nnx.Rngs(0)), plan_cache_size=2
    )
    for n in (10, 20, 10, 30):  # the hit on 10 makes 20 the least recently used
        enc(ref.random_features(ref.TINY, [n]), [n])
    uploads = _count_uploads(monkeypatch)
    enc(ref.random_features(ref.TINY, [10]), np.array([10]))  # kept (a numpy-path hit)
    enc(ref.random_features(ref.TINY, [30]), [30])  # kept
    assert uploads == []
    enc(ref.random_features(ref.TINY, [20]), [20])  # evicted: planned and uploaded again
    assert uploads == [1] and len(enc.plans) == 2


def test_plan_cache_under_threads():
    # Hits take no lock; evictions (cache of 2, 4 mixes) race with them. Every call must still
    # get its own mix's plan: outputs equal the single-threaded ones, the cache stays bounded.
    import concurrent.futures

    enc = q3.Qwen3OmniAudioEncoder(
        q3.Qwen3OmniAudioTower(ref.TINY, rngs=nnx.Rngs(0)), plan_cache_size=2
    )
    mixes = [[120, 30], [30, 120], [7], [99, 0, 1]]
    feats = [jaxsync.async_h2d(q3.pad_features(ref.random_features(ref.TINY, m), m)) for m in mixes]
    want = [np.asarray(enc(f, m).embeddings) for f, m in zip(feats, mixes, strict=True)]

    def run(i):
        k = i % len(mixes)
        return k, np.asarray(enc(feats[k], list(mixes[k])).embeddings)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for k, got in pool.map(run, range(48)):
            np.testing.assert_array_equal(got, want[k])
    assert len(enc.plans) <= 2
