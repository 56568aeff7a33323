"""Chameleon configuration for the image-token paths (VQ-VAE tokenizer, logit mask, merge).

Only the fields these paths read are modelled. `from_hf_config` is strict: a VQ-VAE field that
changes the tokenizer's behaviour and that we do not implement raises, and so does any key it
does not know. Keys that cannot change these paths' results (the text decoder's architecture,
which they never run, token ids, dropouts) are accepted at any value: `IGNORED_FIELDS`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

from jaxsync._host import host_int
from jaxsync.hfconfig import as_dict, check_model_type, unhandled_fields


class _Ignored(NamedTuple):
    config: frozenset[str]
    vq_config: frozenset[str]


IGNORED_FIELDS = _Ignored(
    # `ChameleonConfig`: the text decoder's architecture (outside the image-token paths, which
    # never run the decoder); its token ids (`pad_token_id` only marks the embedding row that
    # initialisation zeroes and training leaves alone: a loaded table is looked up the same);
    # `initializer_range` (fresh weights only); and keys no Chameleon module reads at all,
    # which transformers' own tester config passes (`hidden_dropout_prob`,
    # `attention_probs_dropout_prob`, `type_vocab_size`, `is_decoder`).
    config=frozenset(
        "attention_bias attention_dropout hidden_act intermediate_size max_position_embeddings "
        "mlp_bias model_parallel_size num_attention_heads num_hidden_layers num_key_value_heads "
        "rms_norm_eps rope_parameters rope_theta rope_scaling swin_norm "
        "bos_token_id eos_token_id pad_token_id initializer_range "
        "hidden_dropout_prob attention_probs_dropout_prob type_vocab_size is_decoder".split()
    ),
    # `ChameleonVQVAEConfig`: dropout acts in training only (the VQ model is frozen, in eval
    # mode); `initializer_range` only draws fresh weights.
    vq_config=frozenset({"dropout", "initializer_range"}),
)
"""Keys accepted at any value because they cannot change image tokens, masks or merges."""
_VQ_FIELDS = frozenset(
    {
        "embed_dim",
        "num_embeddings",
        "double_latent",
        "latent_channels",
        "resolution",
        "in_channels",
        "base_channels",
        "channel_multiplier",
        "num_res_blocks",
        "attn_resolutions",
        "attn_type",
    }
)
GROUP_NORM_GROUPS = 32
"""Every GroupNorm of the Chameleon VQ encoder uses 32 groups (fixed in the architecture)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChameleonVQConfig:
    """The Chameleon VQ-VAE encoder + quantizer (defaults = released `facebook/chameleon-7b`).

    Attributes:
      embed_dim: codebook vector size (output channels of `quant_conv`).
      num_embeddings: codebook size (number of VQ codes).
      latent_channels: encoder output channels (input channels of `quant_conv`).
      resolution: input image height and width in pixels.
      in_channels: image channels.
      base_channels: channels of the first level; level i has `base_channels * multiplier[i]`.
      channel_multiplier: one multiplier per level; every level but the last halves the grid.
      num_res_blocks: residual blocks per level.
      attn_resolutions: grid sizes at which each residual block of a level is followed by a
        self-attention block (empty: none).
      attn_type: "vanilla" builds the attention blocks (those of `attn_resolutions` and the mid
        block's); any other value builds none, as upstream (its mid attention is an identity).
    """

    embed_dim: int = 256
    num_embeddings: int = 8192
    latent_channels: int = 256
    resolution: int = 512
    in_channels: int = 3
    base_channels: int = 128
    channel_multiplier: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    attn_resolutions: tuple[int, ...] = ()
    attn_type: str = "vanilla"

    def __post_init__(self) -> None:
        ints = ("embed_dim", "num_embeddings", "latent_channels", "resolution", "in_channels")
        for name in (*ints, "base_channels", "num_res_blocks"):
            host_int(getattr(self, name), name=f"ChameleonVQConfig.{name}", minimum=1)
        for name in ("channel_multiplier", "attn_resolutions"):
            for v in getattr(self, name):
                host_int(v, name=f"ChameleonVQConfig.{name} entry", minimum=1)
        if not self.channel_multiplier:
            raise ValueError("channel_multiplier must be non-empty")
        if not isinstance(self.attn_type, str):
            raise TypeError(f"ChameleonVQConfig.attn_type must be a str, got {self.attn_type!r}")
        # conv_in's output (base_channels) is the first block's GroupNorm input too
        for width in (self.base_channels, *self.level_channels):
            if width % GROUP_NORM_GROUPS:
                raise ValueError(
                    f"every level's channel count must be divisible by {GROUP_NORM_GROUPS} "
                    f"(GroupNorm groups); got base {self.base_channels} and levels "
                    f"{self.level_channels}"
                )
        if self.latent_grid < 1:
            raise ValueError(
                f"resolution {self.resolution} is too small for {self.num_levels} levels"
            )

    @property
    def attention(self) -> bool:
        """Whether the encoder has attention blocks (upstream builds them for "vanilla" only)."""
        return self.attn_type == "vanilla"

    @property
    def num_levels(self) -> int:
        """Number of encoder levels."""
        return len(self.channel_multiplier)

    @property
    def level_channels(self) -> tuple[int, ...]:
        """Output channels of each level."""
        return tuple(self.base_channels * m for m in self.channel_multiplier)

    @property
    def level_resolutions(self) -> tuple[int, ...]:
        """Grid size at each level (the stride-2 downsample with (0, 1) padding floors r / 2)."""
        res = [self.resolution]
        for _ in range(self.num_levels - 1):
            res.append(res[-1] // 2)
        return tuple(res)

    @property
    def latent_grid(self) -> int:
        """Height (= width) of the latent grid."""
        return self.level_resolutions[-1]

    @property
    def tokens_per_image(self) -> int:
        """Image tokens per image (1024 for the released model)."""
        return self.latent_grid**2

    @classmethod
    def from_hf_config(cls, src: Any) -> ChameleonVQConfig:
        """Builds the config from a HF `ChameleonVQVAEConfig` (object, dict, or a checkpoint
        directory / full `ChameleonConfig`, whose `vq_config` is taken), rejecting what we don't
        run.

        Raises:
          TypeError: a non-integer for an integer field (`2.0`, `True`).
          ValueError: `double_latent=True`, an unknown key, or the config of another VQ model
            (its `model_type`; GLM-Image's VQ config has a subset of these fields and another
            architecture).
        """
        vq = as_dict(src, what="Chameleon")
        if "vq_config" in vq or vq.get("model_type") == "chameleon":
            check_model_type(vq, "chameleon", what="Chameleon")
            vq = as_dict(vq.get("vq_config") or {})
        check_model_type(vq, "chameleon_vqgan", what="Chameleon VQ")
        unknown = unhandled_fields(vq, {}, _VQ_FIELDS, ignored=IGNORED_FIELDS.vq_config)
        if unknown:
            raise ValueError(f"unsupported Chameleon vq_config fields: {sorted(unknown)}")
        if vq.get("double_latent", False):
            raise ValueError(
                "vq_config.double_latent=True is not supported (HF cannot run it either)"
            )
        kwargs = {k: vq[k] for k in _VQ_FIELDS - {"double_latent"} if k in vq}
        if "channel_multiplier" in kwargs:
            kwargs["channel_multiplier"] = tuple(kwargs["channel_multiplier"])
        kwargs["attn_resolutions"] = tuple(kwargs.get("attn_resolutions") or ())
        return cls(**kwargs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChameleonConfig:
    """What the Chameleon image-token paths need from a `ChameleonConfig`.

    Attributes:
      vocab_size: text vocabulary size (logits width).
      hidden_size: model width (embedding size).
      vocabulary_map: tokenizer token -> id map (holds the `IMGIMG*` image tokens and `<image>`).
      vq: the VQ-VAE image tokenizer.
    """

    vocab_size: int = 65536
    hidden_size: int = 4096
    vocabulary_map: Mapping[str, int] = dataclasses.field(default_factory=dict)
    vq: ChameleonVQConfig = dataclasses.field(default_factory=ChameleonVQConfig)

    def __post_init__(self) -> None:
        host_int(self.vocab_size, name="vocab_size", minimum=1)
        host_int(self.hidden_size, name="hidden_size", minimum=1)
        for k, v in self.vocabulary_map.items():
            host_int(v, name=f"vocabulary_map[{k!r}]")
        bad = {k: v for k, v in self.vocabulary_map.items() if not 0 <= v < self.vocab_size}
        if bad:
            raise ValueError(f"vocabulary_map ids outside [0, {self.vocab_size}): {_head(bad)}")

    def __hash__(self) -> int:
        # By content, the map included: a module holding the config as a static attribute
        # keys compiled programs by it (jaxsync.TowerProgram shares them per structure).
        fields = (self.vocab_size, self.hidden_size, self.vq)
        return hash((*fields, frozenset(self.vocabulary_map.items())))

    @property
    def image_token_id(self) -> int | None:
        """The `<image>` placeholder id (None if the map has none)."""
        return self.vocabulary_map.get("<image>")

    @classmethod
    def from_hf_config(cls, hf_cfg: Any) -> ChameleonConfig:
        """Builds the config from a HF Chameleon config.

        Args:
          hf_cfg: a dict, a path to `config.json` (or its directory), or an object with
            `to_dict()` (e.g. `transformers.ChameleonConfig`).

        Raises:
          TypeError: a non-integer for an integer field or a vocabulary id.
          ValueError: unknown or unsupported fields, or an inconsistent `image_token_id`.
        """
        d = as_dict(hf_cfg, what="Chameleon")
        if d.get("model_type", "chameleon") != "chameleon":
            raise ValueError(f"not a Chameleon config: model_type={d['model_type']!r}")
        known = ("vocab_size", "hidden_size", "vocabulary_map", "vq_config", "image_token_id")
        unknown = unhandled_fields(d, {}, known, ignored=IGNORED_FIELDS.config)
        if unknown:
            raise ValueError(f"unsupported Chameleon config fields: {sorted(unknown)}")
        vocab_map = {str(k): v for k, v in (d.get("vocabulary_map") or {}).items()}
        cfg = cls(
            vocab_size=d.get("vocab_size", 65536),
            hidden_size=d.get("hidden_size", 4096),
            vocabulary_map=vocab_map,
            vq=ChameleonVQConfig.from_hf_config(d.get("vq_config") or {}),
        )
        given = d.get("image_token_id")
        if given is not None and given != cfg.image_token_id:
            raise ValueError(
                f"image_token_id={given} disagrees with "
                f"vocabulary_map['<image>']={cfg.image_token_id}"
            )
        return cfg


def from_hf_config(src: Any) -> ChameleonConfig:
    """`ChameleonConfig.from_hf_config`: an HF config object, a dict, or a checkpoint directory."""
    return ChameleonConfig.from_hf_config(src)


def _head(d: Mapping[Any, Any], n: int = 5) -> str:
    items = list(d.items())
    more = f" ... ({len(items) - n} more)" if len(items) > n else ""
    return ", ".join(f"{k!r}: {v!r}" for k, v in items[:n]) + more
