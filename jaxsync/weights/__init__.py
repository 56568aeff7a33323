"""Strict Hugging Face safetensors loading into NNX modules through explicit mapping tables."""

from jaxsync.weights._loader import (
    WeightError as WeightError,
    checkpoint_files as checkpoint_files,
    load_weights as load_weights,
    read_checkpoint as read_checkpoint,
    to_numpy_state as to_numpy_state,
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
