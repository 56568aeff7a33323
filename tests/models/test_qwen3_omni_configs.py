"""Qwen3-Omni audio encoder vs transformers for every activation transformers' `ACT2FN` offers
that the towers implement (`jaxsync.models._activations`), weights through the production
loader; and the refusal of a name they do not implement."""

from __future__ import annotations

import dataclasses

import pytest

from jaxsync.models._activations import ACTIVATION_NAMES, activation
from jaxsync.testing import assert_close, requires_torch


# One layer, odd widths: each case compiles in seconds.
LENS = [230, 17]


@requires_torch
@pytest.mark.parametrize("act", ACTIVATION_NAMES)
def test_every_activation_matches_transformers(tmp_path, act):
    import jaxsync
    from jaxsync.harness.paths.qwen3_omni import reference as ref
    from jaxsync.models import qwen3_omni as q3

    cfg = dataclasses.replace(ref.TINY, encoder_layers=1, activation_function=act)
    model = ref.build_hf_encoder(cfg, seed=3)
    ckpt = ref.save_hf_encoder(model, tmp_path / "model.safetensors")
    enc = q3.Qwen3OmniAudioEncoder(q3.load_model(ckpt, cfg))
    x = ref.random_features(cfg, LENS, seed=1)
    out = enc(jaxsync.async_h2d(q3.pad_features(x, LENS)), LENS)
    for got, want in zip(out.split(), ref.reference_outputs(model, x, LENS), strict=True):
        assert_close(got, want, rtol=1e-5, err_msg=act)


def test_unimplemented_activation_is_refused_by_name():
    from jaxsync.models import qwen3_omni as q3

    with pytest.raises(ValueError, match="'mish'"):
        q3.Qwen3OmniAudioConfig(activation_function="mish")
    with pytest.raises(ValueError, match="activation 'mish' is not supported"):
        activation("mish")
