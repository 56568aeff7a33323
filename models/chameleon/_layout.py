"""Where each repeated block of the Chameleon VQ encoder lives in its layer stacks.

The encoder is a ResNet whose levels differ in width, so it has no single repeated layer. Blocks
of one shape are stacked together (`jaxsync.LayerStack`), one stack per kind:
- `res.w{C}`: residual blocks C -> C (every level's later blocks, and the mid block's two);
- `res.w{C}_{C2}`: the first residual block of a level that widens C -> C2;
- `attn.w{C}`: attention blocks of width C (levels in `attn_resolutions`, the mid attention);
- `downsample.w{C}`: the stride-2 convolutions after every level but the last.
The state then holds one leaf per weight kind and width, whatever `num_res_blocks`. Within a
block, the GroupNorm scales and biases and the conv biases of one width are the rows of one
parameter (`block_rows`), so a block's leaves are its conv kernels and one or two row groups.

`encoder_layout(cfg)` says, for one config, how many layers each stack holds, which stack slice
each checkpoint block (`encoder.down.{i}.block.{j}`, `encoder.mid.block_1`, ...) fills, and the
runs the forward executes: consecutive blocks of one stack run as one `span=(a, b)` scan.
"""

from __future__ import annotations

import dataclasses
import functools as ft

from jaxsync.models.chameleon._config import ChameleonVQConfig


GROUPS = ("res", "attn", "downsample")
"""The encoder's stack groups (each an `nnx.Dict` of `jaxsync.LayerStack`s by width key)."""


_NORM_IN = ("norm1.weight", "norm1.bias")
_RES_OUT = ("conv1.bias", "norm2.weight", "norm2.bias", "conv2.bias")
_ATTN = ("norm.weight", "norm.bias", "q.bias", "k.bias", "v.bias", "proj_out.bias")


@ft.cache
def block_rows(group: str, cin: int, cout: int) -> dict[str, tuple[str, int]]:
    """`{checkpoint leaf of the block: (its parameter, row)}`: the block's GroupNorm weights and
    biases and its conv biases, grouped by width.

    A residual block C -> C holds all six in `vectors` `[6, C]`; one that widens C -> C2 holds
    norm1's in `vectors_in` `[2, C]` and the rest (its `nin_shortcut` bias too) in `vectors`
    `[5, C2]`; an attention block holds its norm's and its four projections' in `vectors`
    `[6, C]`. A downsample keeps its conv's bias (it has no other vector).
    """
    if group == "attn":
        return {name: ("vectors", i) for i, name in enumerate(_ATTN)}
    if group != "res":
        return {}
    if cin == cout:
        return {name: ("vectors", i) for i, name in enumerate(_NORM_IN + _RES_OUT)}
    rows = {name: ("vectors_in", i) for i, name in enumerate(_NORM_IN)}
    rows.update({name: ("vectors", i) for i, name in enumerate((*_RES_OUT, "nin_shortcut.bias"))})
    return rows


def width_key(cin: int, cout: int | None = None) -> str:
    """The stack key of a block from `cin` to `cout` channels (`cout` None: same width)."""
    return f"w{cin}" if cout is None or cout == cin else f"w{cin}_{cout}"


@dataclasses.dataclass(frozen=True)
class Slot:
    """One block's place: layer `index` of stack `group.key`."""

    group: str
    key: str
    index: int

    @property
    def path(self) -> str:
        """The per-layer module path the loader maps onto the stacked slice."""
        return f"{self.group}.{self.key}.{self.index}"


@dataclasses.dataclass(frozen=True)
class EncoderLayout:
    """The stacks of one encoder config and the order its forward runs them in.

    Attributes:
      stacks: `{group: {key: (layers, cin, cout)}}`, every stack the encoder builds.
      slots: `{checkpoint block path (after "encoder."): Slot}`, e.g. `down.2.block.0`.
      runs: `(group, key, start, stop)` in forward order: layers start..stop-1 of one stack.
    """

    stacks: dict[str, dict[str, tuple[int, int, int]]]
    slots: dict[str, Slot]
    runs: tuple[tuple[str, str, int, int], ...]


@ft.cache
def encoder_layout(cfg: ChameleonVQConfig) -> EncoderLayout:
    """The layer stacks of `cfg`'s encoder, its checkpoint slots and its forward runs."""
    stacks: dict[str, dict[str, list[int]]] = {g: {} for g in GROUPS}
    slots: dict[str, Slot] = {}
    order: list[Slot] = []

    def place(block: str, group: str, cin: int, cout: int) -> None:
        key = width_key(cin, cout)
        entry = stacks[group].setdefault(key, [0, cin, cout])
        slot = Slot(group, key, entry[0])
        entry[0] += 1
        slots[block] = slot
        order.append(slot)

    cin = cfg.base_channels
    for i, (cout, res) in enumerate(zip(cfg.level_channels, cfg.level_resolutions, strict=True)):
        attention = cfg.attention and res in cfg.attn_resolutions
        for j in range(cfg.num_res_blocks):
            place(f"down.{i}.block.{j}", "res", cin if j == 0 else cout, cout)
            if attention:
                place(f"down.{i}.attn.{j}", "attn", cout, cout)
        if i != cfg.num_levels - 1:
            place(f"down.{i}.downsample", "downsample", cout, cout)
        cin = cout
    place("mid.block_1", "res", cin, cin)
    if cfg.attention:
        place("mid.attn_1", "attn", cin, cin)
    place("mid.block_2", "res", cin, cin)

    runs: list[tuple[str, str, int, int]] = []
    for slot in order:  # consecutive layers of one stack merge into one run
        last = runs[-1] if runs else None
        if last and last[:2] == (slot.group, slot.key) and last[3] == slot.index:
            runs[-1] = (*last[:3], slot.index + 1)
        else:
            runs.append((slot.group, slot.key, slot.index, slot.index + 1))
    frozen = {g: {k: tuple(v) for k, v in s.items()} for g, s in stacks.items()}
    return EncoderLayout(frozen, slots, tuple(runs))
