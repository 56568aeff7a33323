"""Synthetic safetensors checkpoints at a released model's key layout, sizes and dtype.

The names and shapes come from the transformers model class built on the `meta` device (nothing
allocated) and passed through `revert_weight_conversion`, so they are what `save_pretrained`
writes: the layout of the released checkpoints (e.g. per-expert MoE keys, `thinker.audio_tower.*`,
top-level `audio_tower.*`). Tied parameters are written once, as `save_pretrained` does. Shards
follow `save_pretrained`'s split (`huggingface_hub.split_state_dict_into_shards_factory`).

Shards are written tensor by tensor from a repeated random pattern, so memory stays at the pattern
(a few MiB) however large the shard: `safetensors.numpy.save_file` would hold a whole 5 GB shard
twice (arrays and their serialised bytes). The files are plain safetensors (checked on read-back).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One tensor as a shard header describes it."""

    shape: tuple[int, ...]
    code: str  # safetensors dtype code

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.code]


_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "I32": 4, "BOOL": 1}
_PATTERN_DTYPE = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32}


@dataclasses.dataclass(frozen=True)
class Family:
    """A released multimodal model: its transformers class and config, checkpoint dtype, and the
    decoder stacks to truncate (regex whose group 1 is the layer index)."""

    model_class: str
    config: Callable[[str], Any]  # size ("released" / "tiny") -> transformers config
    lm_layers: str
    dtype: str = "BF16"


def _glm4v(size: str) -> Any:
    import transformers

    _released_only("glm4v", size)
    return transformers.Glm4vConfig()  # the defaults are GLM-4.1V-9B


def _qwen3_omni(size: str) -> Any:
    """The thinker of Qwen3-Omni-30B-A3B (the talker and code2wav are not built: their default
    transformers config does not construct)."""
    import dataclasses as dc

    import transformers

    from jaxsync.harness.paths.qwen3_omni import reference as ref

    _released_only("qwen3_omni", size)
    # The released thinker's text config (the transformers defaults are smaller).
    text = dict(hidden_size=2048, num_hidden_layers=48, num_experts=128, num_experts_per_tok=8,
                moe_intermediate_size=768, vocab_size=152064, num_attention_heads=32,
                num_key_value_heads=4)  # fmt: skip
    thinker = dict(audio_config=dc.asdict(ref.RELEASED), vision_config=dict(out_hidden_size=2048),
                   text_config=text)  # fmt: skip
    return transformers.Qwen3OmniMoeConfig(thinker_config=thinker, enable_audio_output=False)


def _voxtral(size: str) -> Any:
    import transformers

    from jaxsync.harness.paths.voxtral import reference as ref

    if size == "released":
        return transformers.VoxtralConfig()  # the defaults are Voxtral-Mini-3B-2507
    cfg = ref.tiny_hf_config()
    # As released, the language model outweighs the tower and has more layers than are written.
    cfg.text_config.vocab_size, cfg.text_config.num_hidden_layers = 4099, 3
    return cfg


def _gemma3n(size: str) -> Any:
    from jaxsync.harness.paths.gemma3n import reference as ref

    return ref.hf_config(size)  # "released": the defaults, gemma-3n-E4B


def _chameleon(size: str) -> Any:
    import transformers

    from jaxsync.harness.paths.chameleon import reference as ref

    _released_only("chameleon", size)
    return transformers.ChameleonConfig(**ref.released_hf_config())


def _released_only(family: str, size: str) -> None:
    if size != "released":
        raise ValueError(f"{family}: only the released size is built (tiny: voxtral, gemma3n)")


FAMILIES: dict[str, Family] = {
    "glm4v": Family(
        "Glm4vForConditionalGeneration", _glm4v, r"model\.language_model\.layers\.(\d+)\."
    ),
    "qwen3_omni": Family(
        "Qwen3OmniMoeForConditionalGeneration", _qwen3_omni, r"thinker\.model\.layers\.(\d+)\."
    ),
    "voxtral": Family(
        "VoxtralForConditionalGeneration", _voxtral, r"language_model\.model\.layers\.(\d+)\."
    ),
    "gemma3n": Family(
        "Gemma3nForConditionalGeneration", _gemma3n, r"model\.language_model\.layers\.(\d+)\."
    ),
    "chameleon": Family("ChameleonForConditionalGeneration", _chameleon, r"model\.layers\.(\d+)\."),
}


@contextlib.contextmanager
def _without_timm_vision(notes: list[str]) -> Iterator[None]:
    """Gemma 3n's vision tower is a timm model; without timm it is left out (noted)."""
    if importlib.util.find_spec("timm") is not None:
        yield
        return
    import torch
    from transformers.models.gemma3n import modeling_gemma3n as mod

    real = mod.AutoModel

    class AutoModel:
        @staticmethod
        def from_config(config: Any, **kwargs: Any) -> Any:
            if config.model_type.endswith("vision"):
                notes.append(f"{config.model_type} tower not written: timm is not installed")
                return torch.nn.Module()
            return real.from_config(config, **kwargs)

    mod.AutoModel = AutoModel
    try:
        yield
    finally:
        mod.AutoModel = real


def released_layout(family: str, size: str = "released") -> tuple[Any, dict[str, Tensor], list]:
    """(transformers config, {key: Tensor} as `save_pretrained` writes them, notes)."""
    import torch
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    spec, notes = FAMILIES[family], []
    hf_cfg = spec.config(size)
    with torch.device("meta"), _without_timm_vision(notes):
        model = getattr(transformers, spec.model_class)(hf_cfg)
    state = model.state_dict()
    params = dict(model.named_parameters())  # a tied parameter once, under its first name
    every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    kept = {k: v for k, v in state.items() if k in params or k not in every}
    codes = {torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL"}
    layout = {
        k: Tensor(tuple(v.shape), spec.dtype if v.is_floating_point() else codes[v.dtype])
        for k, v in revert_weight_conversion(model, kept).items()
    }
    return hf_cfg, layout, notes


def _pattern(code: str, nbytes: int = 4 << 20) -> bytes:
    """Finite random values of the dtype (integers: zeros), as raw bytes."""
    if code not in _PATTERN_DTYPE:
        return bytes(nbytes)
    rng = np.random.default_rng(0)
    n = nbytes // _ITEMSIZE[code]
    return rng.standard_normal(n, dtype=np.float32).astype(_PATTERN_DTYPE[code]).tobytes()


def write_shard(path: Path, tensors: dict[str, Tensor]) -> None:
    """A safetensors file holding `tensors` (pattern bytes), streamed, fsynced, then renamed."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, t in tensors.items():
        header[key] = {"dtype": t.code, "shape": list(t.shape),
                       "data_offsets": [offset, offset + t.nbytes]}  # fmt: skip
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    patterns = {code: _pattern(code) for code in {t.code for t in tensors.values()}}
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in tensors.values():
            left, pattern = t.nbytes, patterns[t.code]
            while left:
                f.write(pattern[: min(left, len(pattern))])
                left -= min(left, len(pattern))
        f.flush()
        os.fsync(f.fileno())  # clean pages, so that posix_fadvise(DONTNEED) can drop them
    tmp.rename(path)


def build_checkpoint(
    family: str,
    directory: Path,
    *,
    size: str = "released",
    lm_layers: int = 2,
    max_shard_size: int | str = "5GB",
) -> dict[str, Any]:
    """Writes (once; reused when `facts.json` matches) the checkpoint and its `config.json`.

    Returns the facts: bytes and shards written, and the released totals; LM layers written and
    released; notes.
    """
    from huggingface_hub import split_state_dict_into_shards_factory

    directory = Path(directory)
    want = dict(family=family, size=size, lm_layers=lm_layers, max_shard_size=max_shard_size)
    facts_file = directory / "facts.json"
    if facts_file.exists():
        facts = json.loads(facts_file.read_text())
        if all(facts.get(k) == v for k, v in want.items()):
            return facts
    hf_cfg, layout, notes = released_layout(family, size)
    pattern = re.compile(FAMILIES[family].lm_layers)
    layers = {int(m.group(1)) for k in layout if (m := pattern.match(k))}
    written = {
        k: t for k, t in layout.items() if not (m := pattern.match(k)) or int(m[1]) < lm_layers
    }
    # Split as the released checkpoint is split, then leave the truncated layers out: each kept
    # tensor sits in the shard (and file name) it has in the released layout, and shards holding
    # only truncated layers are not written.
    split = split_state_dict_into_shards_factory(
        layout,
        get_storage_size=lambda t: t.nbytes,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_shard_size,
    )
    shards = {
        name: {k: written[k] for k in keys if k in written}
        for name, keys in split.filename_to_tensors.items()
    }
    shards = {name: tensors for name, tensors in shards.items() if tensors}
    directory.mkdir(parents=True, exist_ok=True)
    facts_file.unlink(missing_ok=True)  # written last: a partial build is never reused
    for stale in directory.glob("*.safetensors*"):
        stale.unlink()
    (directory / "config.json").write_text(hf_cfg.to_json_string())
    for name, tensors in shards.items():
        write_shard(directory / name, tensors)
    total = sum(t.nbytes for t in written.values())
    if split.is_sharded:
        weight_map = {k: name for name, tensors in shards.items() for k in tensors}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    facts = dict(
        want,
        bytes=total,
        shards=len(shards),
        shards_released=len(split.filename_to_tensors),
        released_bytes=sum(t.nbytes for t in layout.values()),
        lm_layers_written=min(lm_layers, len(layers)),
        lm_layers_released=len(layers),
        notes=notes,
    )
    facts_file.write_text(json.dumps(facts, indent=1))
    return facts
