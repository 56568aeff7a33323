"""Configuration of the GLM-4.1V vision tower (transformers `Glm4vVisionConfig`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxsync._host import host_int
from jaxsync.hfconfig import as_dict, check_model_type, unhandled_fields
from jaxsync.models._activations import ACTIVATION_NAMES, ActivationName


# transformers' `Glm4vVisionConfig()` defaults (the released GLM-4.1V tower), kept here so the
# product reads configs without importing transformers; a test pins them to the class.
HF_DEFAULTS: dict[str, Any] = {
    "depth": 24,
    "hidden_size": 1536,
    "hidden_act": "silu",
    "attention_bias": False,
    "num_heads": 12,
    "in_channels": 3,
    "image_size": 336,
    "patch_size": 14,
    "rms_norm_eps": 1e-05,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 4096,
    "intermediate_size": 13696,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"},
}
# Vision towers with this exact architecture: GLM-4.1V and GLM-4.5V (the MoE language model's
# tower is the same module). Other GLM vision configs reuse these field names for other math
# (GLM-OCR adds q/k norms and MLP biases), so their `model_type` is refused.
_MODEL_TYPES = ("glm4v_vision", "glm4v_moe_vision")
# `Glm4vVisionConfig` keys accepted at any value beyond jaxsync.hfconfig.GENERIC_FIELDS:
# training-only knobs that cannot change inference.
IGNORED_FIELDS = frozenset(
    {
        "attention_dropout",  # dropout is off at inference (the tower runs in eval mode)
        "initializer_range",  # only draws fresh weights
        # the released GLM-4.1V config.json carries it; no module of the tower reads it
        "hidden_dropout_prob",
    }
)
_INT_FIELDS = (
    "depth",
    "hidden_size",
    "num_heads",
    "in_channels",
    "image_size",
    "patch_size",
    "temporal_patch_size",
    "spatial_merge_size",
    "out_hidden_size",
    "intermediate_size",
)


def _square(name: str, value: Any) -> Any:
    """HF allows `int | [a, b]` sizes; the tower (and its square table) needs a == b."""
    if isinstance(value, list | tuple):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"{name} must be an int or a square pair, got {value!r}")
        return value[0]
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class Glm4vVisionConfig:
    """GLM-4.1V vision tower hyper-parameters (defaults: GLM-4.1V-9B, 576-entry 24x24 table).

    Attributes:
      depth: number of transformer blocks.
      hidden_size: model width D.
      num_heads: attention heads N; head dim H = D / N must be a multiple of 4 (2-D rotary).
      hidden_act: activation of the block MLPs and of the merger's gated MLP.
      attention_bias: whether the fused qkv projection has a bias.
      in_channels: pixel channels.
      image_size: side of the pretraining image; the position table is (image_size//patch_size)^2.
      patch_size: spatial patch side.
      temporal_patch_size: frames per temporal patch.
      spatial_merge_size: m; m x m patches are merged into one output token.
      out_hidden_size: width after the downsample conv (also the block MLP width, as upstream).
      intermediate_size: hidden width of the merger's gated MLP.
      rms_norm_eps: epsilon of every RMSNorm.
      rope_theta: rotary base.

    Raises:
      TypeError: a non-integer (float, bool) for an integer field.
      ValueError: inconsistent sizes (see `__post_init__`).
    """

    depth: int = 24
    hidden_size: int = 1536
    num_heads: int = 12
    hidden_act: ActivationName = "silu"
    attention_bias: bool = False
    in_channels: int = 3
    image_size: int = 336
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 4096
    intermediate_size: int = 13696
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self):
        for name in _INT_FIELDS:
            host_int(getattr(self, name), name=name, minimum=1)
        if not isinstance(self.attention_bias, bool):
            raise TypeError(f"attention_bias must be a bool, got {self.attention_bias!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} % num_heads {self.num_heads} != 0")
        if self.head_dim % 4:
            raise ValueError(f"head dim {self.head_dim} must be a multiple of 4 (2-D rotary)")
        if self.hidden_act not in ACTIVATION_NAMES:
            raise ValueError(
                f"hidden_act {self.hidden_act!r} is not supported (supported: {ACTIVATION_NAMES})"
            )
        if self.table_side < 1:
            raise ValueError(f"image_size {self.image_size} < patch_size {self.patch_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def table_side(self) -> int:
        """S: the position table is S x S."""
        return self.image_size // self.patch_size

    @property
    def patch_dim(self) -> int:
        """Pixel values per patch: in_channels * temporal_patch_size * patch_size^2."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf_config(cls, src: Any) -> Glm4vVisionConfig:
        """Builds the config from a transformers `Glm4vVisionConfig` / `Glm4vConfig`, a dict of
        either, or a checkpoint directory (its `config.json`); a full multimodal config gives
        its `vision_config`.

        Raises:
          TypeError: `src` is none of these, or an integer field holds a float or bool.
          ValueError: a field this port does not implement has a non-default value, or the
            config is of another vision tower (its `model_type`).
        """
        got = as_dict(src, what="GLM-4.1V vision")
        if "vision_config" in got:
            got = as_dict(got["vision_config"])
        check_model_type(got, _MODEL_TYPES, what="GLM-4.1V / GLM-4.5V vision tower")
        # every modelled field is read below; anything else must be absent or generic
        unknown = unhandled_fields(got, {}, HF_DEFAULTS, ignored=IGNORED_FIELDS)
        if unknown:
            raise ValueError(f"unsupported Glm4vVisionConfig field(s): {unknown}")
        field = lambda k: got.get(k, HF_DEFAULTS[k])  # noqa: E731
        rope = field("rope_parameters") or {}
        extra = set(rope) - {"rope_type", "rope_theta"}
        if rope.get("rope_type", "axial") != "axial" or extra:
            raise ValueError(f"only axial rope with rope_theta is supported, got {rope}")
        return cls(
            depth=field("depth"),
            hidden_size=field("hidden_size"),
            num_heads=field("num_heads"),
            hidden_act=field("hidden_act"),
            attention_bias=field("attention_bias"),
            in_channels=field("in_channels"),
            image_size=_square("image_size", field("image_size")),
            patch_size=_square("patch_size", field("patch_size")),
            temporal_patch_size=field("temporal_patch_size"),
            spatial_merge_size=field("spatial_merge_size"),
            out_hidden_size=field("out_hidden_size"),
            intermediate_size=field("intermediate_size"),
            rms_norm_eps=float(field("rms_norm_eps")),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )
