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
