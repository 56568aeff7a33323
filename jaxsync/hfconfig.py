"""Strict reading of Hugging Face configs: fields that change the math and are not modelled fail.

Every family's `from_hf_config` diffs the HF config against the HF class default and raises on any
non-default field it does not handle, so an unsupported checkpoint variant fails loudly instead of
loading into the wrong computation.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any


# Bookkeeping fields every `PreTrainedConfig` carries; they never change a forward pass.
GENERIC_FIELDS = frozenset(
    {
        "_attn_implementation",
        "_attn_implementation_autoset",
        "_name_or_path",
        "architectures",
        "chunk_size_feed_forward",
        "dtype",
        "id2label",
        "is_encoder_decoder",
        "label2id",
        "model_type",
        "name_or_path",
        "output_attentions",
        "output_hidden_states",
        "problem_type",
        "return_dict",
        "tie_word_embeddings",
        "torch_dtype",
        "transformers_version",
        "use_cache",
    }
)


def as_dict(cfg: Any) -> dict[str, Any]:
    """A config as a plain dict: a Mapping, an object with `to_dict()`, or a path to
    `config.json` (or to the directory holding it)."""
    if isinstance(cfg, Mapping):
        return dict(cfg)
    if isinstance(cfg, str | os.PathLike):
        path = os.fspath(cfg)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return json.load(f)
    if hasattr(cfg, "to_dict"):
        return cfg.to_dict()
    raise TypeError(
        f"expected an HF config, a dict or a config.json path, got {type(cfg).__name__}"
    )


def _canonical(value: Any) -> Any:
    # JSON round trips turn tuples into lists; compare them as equal.
    if isinstance(value, list | tuple):
        return tuple(_canonical(v) for v in value)
    return value


def unhandled_fields(
    actual: Mapping[str, Any],
    default: Mapping[str, Any],
    handled: Iterable[str],
    *,
    ignored: Iterable[str] = (),
) -> dict[str, Any]:
    """Fields of `actual` that are not handled, not ignored, not generic, and either unknown to
    `default` or different from it.

    >>> unhandled_fields({"a": 1, "b": [1, 2], "dtype": "f32"}, {"a": 1, "b": (1, 2)}, ())
    {}
    >>> unhandled_fields({"a": 2, "new": 0}, {"a": 1}, ())
    {'a': 2, 'new': 0}
    """
    skip = GENERIC_FIELDS | set(handled) | set(ignored)
    missing = object()
    return {
        k: v
        for k, v in actual.items()
        if k not in skip and _canonical(default.get(k, missing)) != _canonical(v)
    }


def reject_unhandled(
    actual: Mapping[str, Any],
    default: Mapping[str, Any],
    handled: Iterable[str],
    *,
    what: str,
    ignored: Iterable[str] = (),
) -> None:
    """Raises `ValueError` naming every field `unhandled_fields` reports."""
    bad = unhandled_fields(actual, default, handled, ignored=ignored)
    if bad:
        raise ValueError(f"unsupported non-default {what} config field(s): {bad}")


def check_model_type(cfg: Mapping[str, Any], allowed: str | tuple[str, ...], *, what: str) -> None:
    """Refuses the config of another model: `ValueError` when `cfg["model_type"]` is set and not
    one of `allowed` (a dict without one, as tests build, passes).

    Other models reuse a family's field names for other math (GLM-OCR's vision tower adds q/k
    norms, AudioFlamingo3's Whisper encoder pools its frames), so the field diff alone would
    load them into the wrong computation.
    """
    allowed = (allowed,) if isinstance(allowed, str) else allowed
    kind = cfg.get("model_type") or allowed[0]
    if kind not in allowed:
        raise ValueError(f"model_type {kind!r} is not a {what} config (supported: {allowed})")
