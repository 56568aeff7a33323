"""Host planning of the Voxtral encoder: which 30-second window belongs to which audio, and
the packed per-call metadata (NumPy only).

A plan's `fields` go up in one `jaxsync.upload_packed`; chunk counts and row offsets stay on the
host. The log-mel front end's own checks and plan are in `_mel_plan.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

import jaxsync
from jaxsync.models.voxtral._config import MelConfig, VoxtralAudioConfig
from jaxsync.models.voxtral._mel_plan import MelPlan


@dataclasses.dataclass(frozen=True)
class VoxtralPlan:
    """Host plan of one encoder call: which 30-second window ("chunk") belongs to which audio.

    Attributes:
      fields: packed int32 metadata: `row_audio` [C_pad] item of each chunk (B_pad for a padding
        chunk: it belongs to no item), `item_chunks` [B_pad] chunks per item; for waveforms also
        the `log_mel_rows` fields.
      num_chunks: `[B]` host chunks per item.
      num_tokens: `[B]` host embeddings per item.
      offsets: `[B]` host first embedding row per item.
      chunks: C_pad, the padded chunk count of the program.
    """

    fields: dict[str, np.ndarray]
    num_chunks: np.ndarray
    num_tokens: np.ndarray
    offsets: np.ndarray
    chunks: int


def plan_chunks(
    num_chunks: np.ndarray, batch_pad: int, chunks: int, cfg: VoxtralAudioConfig
) -> VoxtralPlan:
    """Chunk-to-item tables for `num_chunks[i]` consecutive chunks per item in `chunks` rows."""
    b, total = len(num_chunks), int(num_chunks.sum())
    if total > chunks:
        raise ValueError(f"{total} chunks do not fit the {chunks} chunk rows given")
    row_audio = np.full(chunks, batch_pad, np.int32)
    row_audio[:total] = np.repeat(np.arange(b), num_chunks)
    item_chunks = np.zeros(batch_pad, np.int32)
    item_chunks[:b] = num_chunks
    first = np.concatenate([[0], np.cumsum(num_chunks)[:-1]]).astype(np.int64)
    tokens = num_chunks * cfg.tokens_per_chunk
    fields = {"row_audio": row_audio, "item_chunks": item_chunks}
    return VoxtralPlan(fields, num_chunks, tokens, first * cfg.tokens_per_chunk, chunks)


def plan_waveform_chunks(
    mel: MelPlan,
    batch_pad: int,
    mel_config: MelConfig,
    cfg: VoxtralAudioConfig,
    chunk_buckets: Any,
) -> VoxtralPlan:
    """Every audio zero-padded to whole windows, one log-mel row per window (before any upload:
    too many windows for the largest bucket is a `ValueError` here)."""
    window = cfg.chunk_frames * mel_config.hop_length
    num_chunks = mel.signal // window
    total = int(num_chunks.sum())
    largest = None if chunk_buckets is None else max(chunk_buckets)
    if largest is not None and total > largest:
        raise ValueError(
            f"{total} windows of {window} samples exceed the largest chunk bucket {largest}"
        )
    plan = plan_chunks(num_chunks, batch_pad, jaxsync.bucket(total, chunk_buckets, minimum=1), cfg)
    first = np.repeat(np.concatenate([[0], np.cumsum(num_chunks)[:-1]]), num_chunks)
    row_frame0 = np.zeros(plan.chunks, np.int32)
    row_frame0[:total] = (np.arange(total) - first) * cfg.chunk_frames
    row_frames = np.zeros(plan.chunks, np.int32)
    row_frames[:total] = cfg.chunk_frames
    fields = {"length": mel.fields["length"], "signal": mel.fields["signal"], **plan.fields}
    fields.update(row_frame0=row_frame0, row_frames=row_frames)
    return dataclasses.replace(plan, fields=fields)
