"""examples/sglang_jax_style.py: an `embed_mm` jitted over flat state leaves, static lengths."""

import importlib.util
from pathlib import Path

import pytest


def _load():
    path = Path(__file__).resolve().parents[1] / "examples" / "sglang_jax_style.py"
    spec = importlib.util.spec_from_file_location("sglang_jax_style", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_runs_sync_free_without_recompiles(capsys):
    # asserts entry parity, 0 compiles, 0 reads, updates seen, one program per bucket
    _load().main()
    out = capsys.readouterr().out
    assert "0 compiles and 0 host reads" in out
    assert "'tensor': 2" in out  # the renamed rules sharded the tower (8 CPU devices in tests)


def test_example_would_catch_a_read_back(monkeypatch):
    # Negative control: a runner that reads the fused rows back (as sglang-jax's encode pass
    # does, to hold them per request) is caught by the guard.
    import numpy as np

    from jaxsync.check import SyncError

    example = _load()
    jitted = example.jitted_embed_mm

    def reads_back(*args, **kwargs):
        out = jitted(*args, **kwargs)
        np.asarray(out[0])  # a device->host read
        return out

    monkeypatch.setattr(example, "jitted_embed_mm", reads_back)
    with pytest.raises(SyncError):
        example.main()


def test_example_would_catch_misplaced_rows(monkeypatch):
    # Negative control: rows written in the wrong order fail the parity check against the entry.
    example = _load()
    original = example.Qwen3OmniAudioPrompt.encode_audio

    def reversed_rows(self, *args, **kwargs):
        return original(self, *args, **kwargs)[::-1]

    monkeypatch.setattr(example.Qwen3OmniAudioPrompt, "encode_audio", reversed_rows)
    with pytest.raises(AssertionError):
        example.main()


def test_example_would_catch_a_recompile(monkeypatch):
    # Negative control: a static value per length mix (sglang-jax's static lengths) in the
    # planned call makes the second mix compile again.
    from jaxsync.check import RecompileError

    example = _load()
    jitted = example.jitted_embed_mm

    def keyed_by_mix(*args, mm_audio_meta=None, **kwargs):
        if mm_audio_meta is not None:  # args[9]: mm_audio_feature_lengths, a static argument
            args = (*args[:9], id(mm_audio_meta), *args[10:])  # one static key per mix
        return jitted(*args, mm_audio_meta=mm_audio_meta, **kwargs)

    monkeypatch.setattr(example, "jitted_embed_mm", keyed_by_mix)
    with pytest.raises(RecompileError):
        example.main()


def _explicit_run(example, rules):
    """The drop-in on sglang-jax's own mesh: ("data", "tensor") with explicit axis types, the
    call inside `jax.set_mesh` as its runner makes it. Returns (fused, ids, text table, entry
    rows)."""
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

    import jaxsync
    from jaxsync.harness.paths.qwen3_omni.reference import TINY, random_features
    from jaxsync.models import qwen3_omni

    devices = np.array(jax.devices()[:2]).reshape(1, 2)
    mesh = Mesh(devices, ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)
    lens = (150, 37)
    tokens = qwen3_omni.feat_extract_output_lengths(lens, TINY.n_window).tolist()
    ids = example._prompt(tokens, np.random.default_rng(0))
    with jax.set_mesh(mesh):
        model = example.Qwen3OmniAudioPrompt(TINY, mesh=mesh)
        example.shard(model, mesh, rules)
        model_def, state = nnx.split(model)
        leaves, state_def = jax.tree_util.tree_flatten(state)
        repl = NamedSharding(mesh, PartitionSpec())
        features = jaxsync.async_h2d(random_features(TINY, lens), placement=repl)
        fused, _, _ = example.jitted_embed_mm(
            model_def, state_def, leaves, jaxsync.async_h2d(ids, placement=repl),
            None, None, None, None, features, lens,
        )  # fmt: skip
    entry = qwen3_omni.Qwen3OmniAudioEncoder(model.audio_tower)  # uploads beside the weights
    rows = entry(random_features(TINY, lens), lens)
    return fused, ids, model.embed_tokens.embedding[...], rows


def test_explicit_axis_mesh_runs_the_tower_replicated():
    # sglang-jax's mesh (explicit axis types) with its towers replicated, as it loads them
    example = _load()
    example._check(*_explicit_run(example, ()))


def test_explicit_axis_mesh_refuses_a_sharded_tower():
    # The limit docs/serving.md states: on explicit axes a tower split over "tensor" stops at
    # its first head reshape (JAX asks for the reshape's output sharding), so shard it on a
    # mesh of auto axes (the example's) or run it replicated there.
    from jax._src.core import ShardingTypeError

    example = _load()
    from jaxsync.models import qwen3_omni

    rules = example.rename_axis(qwen3_omni.PARTITION_RULES, "model", "tensor")
    with pytest.raises(ShardingTypeError, match="reshape"):
        _explicit_run(example, rules)
