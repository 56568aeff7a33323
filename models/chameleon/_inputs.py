"""Chameleon's image input: pixels as the tokenizer takes them, checked on the host.

`ChameleonImageProcessor` gives `[B, C, R, R]` normalised pixels (numpy or a torch CPU tensor);
a server may pass a device array instead, possibly split over a mesh's data axis. Both are
checked by shape and dtype (host pixels' values as they are staged), before anything is planned
or uploaded.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxsync._calls import reads
from jaxsync._host import host_array
from jaxsync.models.chameleon._vocab import check_device_array


PIXELS = "pixel_values"
_FLOATS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(jnp.bfloat16))


def host_pixels(pixel_values: Any) -> np.ndarray:
    """Host pixels (numpy or a torch CPU tensor) as numpy; float64 narrowed to float32."""
    x = host_array(pixel_values, name=PIXELS)
    if x.dtype == np.float64:  # numpy's default float: narrowed exactly as the model would
        x = x.astype(np.float32)
    return x


def check_pixels(x: Any, image_shape: tuple[int, int, int]) -> int:
    """The number of images in `[B, *image_shape]` pixels (host or device: shape and dtype only).

    Raises:
      TypeError: a dtype other than float32/float16/bfloat16. ValueError: another shape, no image.
    """
    shape = tuple(x.shape)
    if len(shape) != 4 or shape[1:] != image_shape:
        raise ValueError(
            f"{PIXELS} must have shape (B, {', '.join(map(str, image_shape))}), got {shape}"
        )
    if np.dtype(x.dtype) not in _FLOATS:
        raise TypeError(f"{PIXELS} must be float32/float16/bfloat16, got {x.dtype}")
    if shape[0] < 1:
        raise ValueError(f"{PIXELS} holds no image")
    return shape[0]


def pixel_checks(image_shape: tuple[int, int, int]) -> tuple:
    """The entry's checks of device pixels, each declared with what it reads (the call key's):
    a live device array, then `[B, *image_shape]` in a float dtype."""

    @reads("type", "live")
    def live(pixel_values: Any) -> None:
        check_device_array(pixel_values, PIXELS)

    @reads("shape", "dtype")
    def shaped(pixel_values: Any) -> int:
        return check_pixels(pixel_values, image_shape)

    return live, shaped
