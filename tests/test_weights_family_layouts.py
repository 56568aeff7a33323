"""The families' reshaping weight rules refuse a tensor stored in another layout of the same size.

A Conv3d patch kernel with C and T swapped, a downsample Conv2d stored channels-last, or a
qwen3_omni `conv_out` stored transposed hold the right number of elements; only a check of the
stored shape before the reshape tells them from the right layout.
"""

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxsync.models import glm4v, qwen3_omni
from jaxsync.weights import WeightError


def _glm4v_tensors(key, move):
    from jaxsync.harness.paths.glm4v import reference as ref

    tower = ref.build_reference(ref.hf_config(**ref.TINY))
    state = {k: v.detach().numpy() for k, v in tower.state_dict().items()}
    if key is not None:
        state[key] = np.ascontiguousarray(np.moveaxis(state[key], *move))
    return state


@pytest.mark.parametrize(
    "key, move",
    [
        (None, None),  # the right layout loads (positive control)
        ("patch_embed.proj.weight", (1, 2)),  # [D, C, T, p, p] with C and T swapped
        ("downsample.weight", (1, 3)),  # [O, D, m, m] stored channels-last
    ],
)
def test_glm4v_conv_layouts(tmp_path, key, move):
    from jaxsync.harness.paths.glm4v import reference as ref

    pytest.importorskip("torch")
    hf_cfg = ref.hf_config(**ref.TINY)
    cfg = glm4v.Glm4vVisionConfig.from_hf_config(hf_cfg)
    if key is not None and cfg.in_channels == cfg.temporal_patch_size:
        pytest.skip("C == T: a swap would not change the shape")
    state = _glm4v_tensors(key, move)
    path = tmp_path / "tower.safetensors"
    save_file(state, path)
    if key is None:
        assert isinstance(glm4v.load_model(path, cfg), glm4v.Glm4vVisionTower)
        return
    with pytest.raises(WeightError, match=key.replace(".", r"\.")):
        glm4v.load_model(path, cfg)


@pytest.mark.parametrize("transposed", [False, True])
def test_qwen3_omni_conv_out_layout(tmp_path, transposed):
    from jaxsync.harness.paths.qwen3_omni import reference as ref

    pytest.importorskip("torch")
    model = ref.build_hf_encoder(ref.TINY)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    w = state["conv_out.weight"]  # [D, C * F]
    assert w.shape[0] != w.shape[1], "a square conv_out could not tell the layouts apart"
    if transposed:
        state["conv_out.weight"] = np.ascontiguousarray(w.T)
    path = tmp_path / "encoder.safetensors"
    save_file(state, path)
    if not transposed:
        assert isinstance(qwen3_omni.load_model(path, ref.TINY), qwen3_omni.Qwen3OmniAudioTower)
        return
    with pytest.raises(WeightError, match=r"conv_out\.weight"):
        qwen3_omni.load_model(path, ref.TINY)
