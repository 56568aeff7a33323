"""examples/serving_step.py runs sync-free and recompile-free at a tiny size."""

import importlib.util
from pathlib import Path

import pytest


def _load():
    path = Path(__file__).resolve().parents[1] / "examples" / "serving_step.py"
    spec = importlib.util.spec_from_file_location("serving_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serving_loop_is_sync_free_and_deterministic(monkeypatch):
    monkeypatch.setenv("JAXSYNC_SYNC_CHECK", "error")
    example = _load()
    first = example.run(steps=20, quiet=True)
    second = example.run(steps=20, quiet=True)
    assert first["unintended_host_syncs"] == 0
    assert len(first["tokens"]) == 20 and first["deliberate_delayed_reads"] == 20
    assert first["tokens"] == second["tokens"]


def test_serving_loop_guard_would_catch_a_sync(monkeypatch):
    # Negative control: a server that reads the token back inside the step is caught.
    from jaxsync.check import SyncError

    example = _load()
    original = example.Server.decode_step

    def reads_back(self, token, blocks, pos):
        out = original(self, token, blocks, pos)
        int(out[0])
        return out

    monkeypatch.setattr(example.Server, "decode_step", reads_back)
    with pytest.raises(SyncError):
        example.run(steps=4, quiet=True)
