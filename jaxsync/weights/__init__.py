"""Strict Hugging Face safetensors loading into NNX modules through explicit mapping tables."""

from jaxsync.weights._checkpoint import (
    WeightError as WeightError,
    checkpoint_dtype as checkpoint_dtype,
    checkpoint_files as checkpoint_files,
    checkpoint_keys as checkpoint_keys,
    read_checkpoint as read_checkpoint,
)
from jaxsync.weights._loader import (
    LoadStats as LoadStats,
    last_load_stats as last_load_stats,
    load_weights as load_weights,
    to_numpy_state as to_numpy_state,
)
from jaxsync.weights._placement import (
    PartitionRules as PartitionRules,
    partition_spec as partition_spec,
)
from jaxsync.weights._rules import (
    Rule as Rule,
    Transform as Transform,
    compose as compose,
    conv as conv,
    linear as linear,
    reshape as reshape,
    transpose as transpose,
)
