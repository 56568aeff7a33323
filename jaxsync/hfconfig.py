"""Strict reading of Hugging Face configs: fields that change the math and are not modelled fail.

Every family's `from_hf_config` diffs the HF config against the HF class default and raises on any
non-default field it does not handle, so an unsupported checkpoint variant fails loudly instead of
loading into the wrong computation. Keys that cannot change a family's result (the text model's
token ids, dropout probabilities, training-only flags, attributes the upstream module never reads)
are listed once per family, each with the reason, and passed here as `ignored`; settings that
transformers itself drops when it loads a config (`DROPPED_BY_TRANSFORMERS`) are skipped for all.

A config read from disk (`as_dict` of a path) fails as `jaxsync.weights.WeightError` naming the
path the caller gave: a path that does not exist (a Hub id is not downloaded), a folder without
`config.json`, a `config.json` that is not a JSON object.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from jaxsync.weights._checkpoint import HUB_HINT, WeightError


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

# Settings that older transformers saved in model configs and that transformers' own
# `PreTrainedConfig` now drops when it loads one (generation settings, the Hub revision), so no
# module ever reads them. A test pins the list to the installed transformers.
DROPPED_BY_TRANSFORMERS = frozenset(
    "_commit_hash assistant_confidence_threshold assistant_lookbehind bad_words_ids "
    "begin_suppress_tokens diversity_penalty do_sample early_stopping "
    "encoder_no_repeat_ngram_size encoder_repetition_penalty epsilon_cutoff eta_cutoff "
    "exponential_decay_length_penalty forced_bos_token_id forced_eos_token_id length_penalty "
    "max_length min_length no_repeat_ngram_size num_assistant_tokens "
    "num_assistant_tokens_schedule num_beam_groups num_beams num_return_sequences output_scores "
    "remove_invalid_values repetition_penalty return_dict_in_generate suppress_tokens "
    "target_lookbehind temperature top_k top_p typical_p use_cache".split()
)


# Keys that transformers 4.x's `PretrainedConfig.to_dict()` wrote into every config it saved,
# sub-configs included, at these defaults (and that current transformers keeps when it loads such
# a config): accepted at exactly these values. At another value some change the model (pruned
# heads, cross-attention, a decoder mask), so a family refuses them unless it handles them.
LEGACY_DEFAULTS: dict[str, Any] = {
    "add_cross_attention": False,
    "bos_token_id": None,
    "cross_attention_hidden_size": None,
    "decoder_start_token_id": None,
    "eos_token_id": None,
    "finetuning_task": None,
    "gradient_checkpointing": False,
    "is_decoder": False,
    "pad_token_id": None,
    "prefix": None,
    "pruned_heads": {},
    "sep_token_id": None,
    "task_specific_params": None,
    "tf_legacy_loss": False,
    "tie_encoder_decoder": False,
    "tokenizer_class": None,
    "torchscript": False,
    "use_bfloat16": False,
    "xla_device": None,
}


class MissingConfigError(WeightError, FileNotFoundError):
    """No `config.json` where one was asked for (also a `FileNotFoundError`, as `open` raises)."""


class BrokenConfigError(WeightError, json.JSONDecodeError):
    """A `config.json` that is not JSON (also a `json.JSONDecodeError`, as `json.load` raises)."""

    def __init__(self, message: str, doc: str, pos: int):
        json.JSONDecodeError.__init__(self, message, doc, pos)
        self.args = (message,)


def as_dict(cfg: Any, *, what: str = "Hugging Face") -> dict[str, Any]:
    """A config as a plain dict: a Mapping, an object with `to_dict()`, or a path: a folder
    holding `config.json`, the `config.json` itself, or a checkpoint file or index beside one.

    Raises:
      jaxsync.weights.WeightError: a path that does not exist, no `config.json` there, or one
        that is not a JSON object; the message names the path given and the `what` config.
      TypeError: `cfg` is none of these.
    """
    if isinstance(cfg, Mapping):
        return dict(cfg)
    if isinstance(cfg, str | os.PathLike):
        return _read_config(os.fspath(cfg), what)
    if hasattr(cfg, "to_dict"):
        return cfg.to_dict()
    raise TypeError(
        f"expected an HF config, a dict or a config.json path, got {type(cfg).__name__}"
    )


def _read_config(given: str, what: str) -> dict[str, Any]:
    where = f"cannot read a {what} config from {given!r}"
    path = Path(given)
    if path.is_dir():
        file = path / "config.json"
    elif path.name.endswith(".json") and not path.name.endswith(".index.json"):
        file = path
    else:  # a safetensors file or a sharded index: the config.json beside it
        file = path.parent / "config.json"
    if not path.exists():
        raise MissingConfigError(f"{where}: it does not exist. {HUB_HINT}")
    if not file.is_file():
        raise MissingConfigError(f"{where}: no config.json in {str(file.parent)!r}")
    try:
        text = file.read_text(encoding="utf-8")
        data = json.loads(text)
    except UnicodeDecodeError as e:
        raise BrokenConfigError(f"{where}: {str(file)!r} is not UTF-8 text", "", e.start) from None
    except json.JSONDecodeError as e:
        msg = (
            f"{where}: {str(file)!r} is not valid JSON ({e.msg}: line {e.lineno} column {e.colno})"
        )
        raise BrokenConfigError(msg, e.doc, e.pos) from None
    except OSError as e:
        raise WeightError(f"{where}: {str(file)!r} is unreadable ({e.strerror})") from None
    if not isinstance(data, dict):
        raise WeightError(
            f"{where}: {str(file)!r} holds a JSON {type(data).__name__}, not an object"
        )
    return data


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
    """Fields of `actual` that are not handled, not ignored, not generic (nor dropped by
    transformers), and either unknown to `default` or different from it; a key `default` lacks
    passes at its `LEGACY_DEFAULTS` value (what older transformers saved).

    >>> unhandled_fields({"a": 1, "b": [1, 2], "dtype": "f32"}, {"a": 1, "b": (1, 2)}, ())
    {}
    >>> unhandled_fields({"a": 2, "new": 0}, {"a": 1}, ())
    {'a': 2, 'new': 0}
    >>> unhandled_fields({"pruned_heads": {}, "is_decoder": True}, {}, ())
    {'is_decoder': True}
    """
    skip = GENERIC_FIELDS | DROPPED_BY_TRANSFORMERS | set(handled) | set(ignored)
    missing = object()
    return {
        k: v
        for k, v in actual.items()
        if k not in skip
        and _canonical(default.get(k, LEGACY_DEFAULTS.get(k, missing))) != _canonical(v)
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
