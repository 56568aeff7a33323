"""examples/tpu_inference_style.py: a server-owned (graphdef, state), rebuilt every call."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from jaxsync.testing import requires_torch


def _load():
    path = Path(__file__).resolve().parents[1] / "examples" / "tpu_inference_style.py"
    spec = importlib.util.spec_from_file_location("tpu_inference_style", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@requires_torch
def test_example_runs_sync_free_without_recompiles(capsys):
    _load().main()  # asserts parity with the entry, 0 compiles, 0 reads, updates seen
    assert "0 compiles and 0 host reads" in capsys.readouterr().out


@requires_torch
def test_example_would_catch_a_read_back(monkeypatch):
    # Negative control: a model class that reads its embeddings back is caught by the guard.
    from jaxsync.check import SyncError

    example = _load()
    original = example.Glm4vMultimodal.embed_multimodal

    def reads_back(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        np.asarray(out[0])  # a device->host read
        return out

    monkeypatch.setattr(example.Glm4vMultimodal, "embed_multimodal", reads_back)
    with pytest.raises(SyncError):
        example.main()
