"""TowerEncoder: what every family's entry class shares around its `TowerEntry`.

A family's entry (`<Family><Modality>Encoder`) subclasses it and supplies its checks, its
planner, its forward and its options:

    class FooEncoder(TowerEncoder):
        load_model = staticmethod(load_model)         # gives `FooEncoder.from_pretrained`

        def __init__(self, model, *, placement=None, out_sharding=None):
            expect(model, FooTower)
            super().__init__(model, forward, name="x", checks=(alive("x"), self._check),
                             inside="x", placement=placement, out_sharding=out_sharding,
                             plan_of=lambda lengths: lengths_planner(lengths, model.cfg))

        @entry_point
        def __call__(self, x, lengths):
            return self._entry(x, lengths)   # a repeated call: one lookup; else the full path

The base holds the program (`TowerProgram(model, forward)`, shared by every encoder of the same
structure), the entry (its plan and call caches), the weights' devices, where per-call data goes
(`jaxsync._placement`'s one rule), and the methods every entry offers: `from_pretrained`,
`load_state`, `lower`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
from flax import nnx

from jaxsync._entry import TowerEntry, on_devices
from jaxsync._out_sharding import OutSharding, check_out_sharding, with_out_sharding
from jaxsync._placement import Placement, entry_placement, replicated
from jaxsync._tower import TowerProgram


def expect(model: Any, tower: type, hint: str = "") -> None:
    """Refuses a model of another type than `tower` as `TypeError`, before anything is built."""
    if not isinstance(model, tower):
        raise TypeError(f"model must be a {tower.__name__}{hint}, got {type(model).__name__}")


def weight_devices(model: nnx.Module) -> frozenset:
    """Every device the model's weights live on."""
    return frozenset(d for x in jax.tree.leaves(nnx.state(model)) for d in x.sharding.device_set)


class TowerEncoder:
    """The base of a family's entry over `TowerProgram(model, forward)`.

    The program is the function a server jits over the model's state leaves, compiled once per
    structure and shared by every encoder of it. The encoder snapshots the weights: after
    `nnx.update` of the model, call `load_state(model)` (no recompile).

    Options every family's entry takes, with the same meaning:
      placement: a device or sharding for host inputs (e.g. `NamedSharding(mesh, P("data"))`
        for a batch split over "data"); None: replicated beside the weights. One on other
        devices than the weights is refused. Device inputs stay where they are (on the
        weights' devices); per-call metadata goes replicated beside the input.
      plan_cache_size: plans (and their uploaded metadata) kept, least recently used first out.
      out_sharding: where the rows go (`forward`'s option): None replicates them over the
        weights' mesh; a `PartitionSpec` over that mesh or a `Sharding` as the server asks.

    Args:
      model: the family's tower; its `cfg` becomes the encoder's.
      forward: the family's forward (its options bound but `out_sharding`).
      name: the device input's name in errors.
      checks: the family's checks of a device input, each declared with `reads`.
      inside: a device input must live on the weights' devices (named so in the error);
        None: the family checks placement itself.
      placement, out_sharding: above (either refused at construction: `TypeError` for another
        type, `ValueError` for devices or axes the weights do not have).
      fits, plan_cache_size: as `TowerEntry`'s.
      entry: what builds the entry, called as `TowerEntry` is (default), e.g. a
        `functools.partial` of `jaxsync._batching.BucketEntry` with its options bound.
      call: the entry's call options (`plan_of`, `rank`, `shape`, `dtype`, `miss`: as
        `TowerEntry`'s), for `self._entry(x, *metadata)`.

    Attributes:
      cfg: the tower's config.
      placement: where host inputs go (`placement` resolved).
      out_sharding: where the rows go, as given.
      program: the `jaxsync.TowerProgram` (`.lower(...)`, `.leaves`, `.num_state_args`).
      plans: the `PlanCache` of plans and their uploads (`len()`, `clear()`).
    """

    load_model: Callable[..., nnx.Module] | None = None  # the family's checkpoint loader

    @classmethod
    def from_pretrained(
        cls, checkpoint: Any, cfg: Any = None, *, dtype: Any = None, mesh: Any = None,
        partition_rules: Any = None, **options: Any,
    ) -> Any:  # fmt: skip
        """The encoder of a checkpoint: `cls(load_model(checkpoint, cfg, dtype=, mesh=,
        partition_rules=), **options)` with the family's loader (a directory with `config.json`,
        or a safetensors file with `cfg`; weights read lazily, split over `mesh` by the family's
        `PARTITION_RULES` unless `partition_rules` are given)."""
        if cls.load_model is None:
            raise TypeError(f"{cls.__name__} has no checkpoint loader (`load_model`)")
        rules = {} if partition_rules is None else {"partition_rules": partition_rules}
        return cls(cls.load_model(checkpoint, cfg, dtype=dtype, mesh=mesh, **rules), **options)

    def __init__(
        self,
        model: nnx.Module,
        forward: Callable[..., Any],
        *,
        name: str,
        checks: Iterable[Callable[[jax.Array], Any]] = (),
        inside: str | None = None,
        placement: Placement = None,
        out_sharding: OutSharding = None,
        fits: Callable[[jax.Array, Any], Any] | None = None,
        plan_cache_size: int = 64,
        entry: Callable[..., TowerEntry] = TowerEntry,
        **call: Any,
    ):
        self.cfg = model.cfg
        self._weights = weight_devices(model)
        self.placement = entry_placement(placement, jax.tree.leaves(nnx.state(model))[0])
        self._meta_at = replicated(self.placement, "device")  # host inputs' metadata
        if inside is not None:  # `_inside`: the same check, for the family's other inputs
            self._inside = on_devices(self._weights, inside)
            checks = (*checks, self._inside)
        self.out_sharding = check_out_sharding(model, out_sharding, self._weights)
        self._programs: list[TowerProgram] = []  # what `load_state` updates
        self.program = self._program_of(model, forward)
        options = dict(name=name, checks=checks, fits=fits, plan_cache_size=plan_cache_size,
                       placement=self._meta_at, stage_at=self.placement, **call)  # fmt: skip
        self._entry_kind, self._entry_options = entry, options  # what `_entry_over` builds with
        self._entry = entry(self.program, **options)
        self.plans = self._entry.plans
        self._calls = self._entry.calls  # repeated calls on device inputs

    def _program_of(self, model: nnx.Module, forward: Callable[..., Any]) -> TowerProgram:
        """`TowerProgram(model, forward)` with the encoder's `out_sharding` bound, updated by
        `load_state` (a family's second program: another input kind)."""
        program = TowerProgram(model, with_out_sharding(forward, self.out_sharding))
        self._programs.append(program)
        return program

    def _entry_over(self, program: TowerProgram, **options: Any) -> TowerEntry:
        """Another entry over the encoder's plan cache (another output form, or another program,
        which `load_state` then updates too), built as the first: `options` replace its."""
        if program not in self._programs:
            self._programs.append(program)
        return self._entry_kind(program, **{**self._entry_options, "plans": self.plans, **options})

    def load_state(self, model: nnx.Module) -> None:
        """Takes the weights of `model` (e.g. after `nnx.update`) without recompiling.

        Raises:
          ValueError: another structure, shape, dtype or placement than the encoder was built
            with (build a new encoder for another model).
        """
        for program in self._programs:
            program.load_state(model)
        self._took(model)

    def _took(self, model: nnx.Module) -> None:
        """What the family keeps of the weights besides its programs (a table), on new weights."""

    def lower(self, *inputs: Any) -> Any:
        """`jax.jit(...).lower` of the program on device inputs and the packed meta (argument
        counts, HLO, cost analysis)."""
        return self.program.lower(*inputs)
