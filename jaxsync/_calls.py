"""Repeated calls on device inputs: one dictionary hit between a host entry and its program.

An entry validates its inputs, finds its cached plan and dispatches (`PlanCache` already makes
the plan a lookup). Those checks are two dozen small Python steps: a few microseconds warm, but
a server's call right after its thread waited for the device runs them with cold caches, many
times slower, and then they cost more than the dispatch itself. A `CallCache` keys a call on
device data by everything its checks read (the array's type, shape, dtype, sharding and
commitment, and the exact content of the host metadata beside it) and keeps the prepared call
the full path built: a repeated call runs the program and the output wrapper, nothing else.

    run, key = self._calls.find(x, grid)      # run None: a miss, traced or unkeyable input
    if run is not None:
        return run(x)
    ...validate, plan, build `prepared(x)`...
    return self._calls.keep(key, prepared_call(prepared, "pixel_values"))(x)

What a key cannot see, the prepared call catches: a deleted (donated) array makes the program
refuse it before any launch, and `prepared_call` turns that into the entry's documented
`ValueError`.

The key rule: a key covers every check a hit skips. An entry's checks of its device input
declare what they read (`@reads("shape", "dtype")`), and `CallCache(checks=...)` keys exactly
those fields, so a check and its key cannot drift apart: a field no key can cover (the array's
values) is refused when the cache is built, and "live" is what `prepared_call` re-checks on
every call.

A call on several device arrays (a paged KV copy's source and destination caches) is keyed as
one tree (`find_tree`): every leaf's fields, and where declared the tree's structure, which
leaves are one array ("aliasing") and the call's scalar options by type and value.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import jax

from jaxsync._plans import PlanCache, metadata_key


# Concrete (never traced) array types seen so far: a type test instead of two isinstance ones.
_LIVE_TYPES: set[type] = set()


def _live(x: Any) -> bool:
    """`x` is a concrete device array (its type then joins `_LIVE_TYPES`)."""
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        _LIVE_TYPES.add(type(x))
        return True
    return False


# What a check of a device input may read, and the attribute a key takes it from. "metadata" is
# the exact content of the host metadata beside the input (always keyed); "live" (not deleted)
# is re-checked by the kept call itself on every call.
KEYED = {
    "type": "__class__",
    "shape": "shape",
    "dtype": "dtype",
    "sharding": "sharding",
    "committed": "committed",
}
PER_CALL = frozenset({"live", "metadata"})
_ALL = ("shape", "dtype", "sharding", "committed")
# What a check of a tree of device arrays may read besides its leaves (`find_tree`): the tree's
# structure (its treedef), which leaves are one array, and the call's scalar options.
TREE = ("structure", "aliasing", "options")
# Options a tree key holds by type and value (1, 1.0 and True hash alike: their types differ).
_SCALARS = frozenset({str, int, bool, float, type(None)})


def reads(*fields: str) -> Callable[[Callable], Callable]:
    """Declares what a check of a device input reads (names of `KEYED`, "live", "metadata").

    A `CallCache` built with `checks=` keys exactly the union of its checks' declarations.
    """
    unknown = set(fields) - set(KEYED) - PER_CALL - set(TREE)
    if unknown:
        raise ValueError(
            f"a kept call cannot skip a check reading {sorted(unknown)}: no key covers it "
            f"(keyable: {sorted(KEYED)}, of a tree: {sorted(TREE)}, re-checked per call: "
            f"{sorted(PER_CALL)})"
        )

    def mark(check: Callable) -> Callable:
        check.reads = frozenset(fields)  # type: ignore[attr-defined]
        return check

    return mark


def declared(checks: Iterable[Callable]) -> frozenset[str]:
    """The union of `checks`' `reads`.

    Raises:
      TypeError: a check without a `reads` declaration.
    """
    fields: set[str] = set()
    for check in checks:
        reads_ = getattr(check, "reads", None)
        if reads_ is None:
            raise TypeError(f"check {check!r} declares nothing it reads: decorate it with reads()")
        fields |= reads_
    return frozenset(fields)


def key_fields(checks: Iterable[Callable]) -> tuple[str, ...]:
    """The input fields a key must cover: the union of `checks`' `reads`, in a fixed order.

    Raises:
      TypeError: a check without a `reads` declaration.
    """
    fields = declared(checks)
    return tuple(f for f in KEYED if f in fields)


def _getter(fields: tuple[str, ...]) -> Callable[[Any], tuple]:
    names = [KEYED[f] for f in fields]
    if not names:
        return lambda x: ()
    return operator.attrgetter(*names)  # one C call (a single field: its value, no tuple)


_FULL = _getter(_ALL)


def call_key(x: Any, *metadata: Any) -> Hashable | None:
    """The signature of a call on the device array `x` with host `metadata`, or None.

    None when `x` is not a live device array (host data, a tracer) or some metadata has no
    content key (see `metadata_key`); a None metadata counts as absent. The signature is
    `(shape, dtype, sharding, committed, *metadata keys)`.
    """
    return _key(_FULL, x, metadata)


def _key(fields: Callable[[Any], Any], x: Any, metadata: tuple) -> Hashable | None:
    """`call_key` over the input fields `fields(x)` reads."""
    if type(x) not in _LIVE_TYPES and not _live(x):
        return None
    got = fields(x)
    parts: list[Any] = list(got) if fields is _FULL else [got]
    for m in metadata:
        if m is None:
            parts.append(None)
            continue
        k = metadata_key(m)
        if k is None:
            return None
        parts.append(k)
    return tuple(parts)


def aliasing(leaves: list) -> tuple[int, ...]:
    """Which leaves are one array: leaf i's entry is the index of its first occurrence."""
    first: dict[int, int] = {}
    return tuple(map(first.setdefault, map(id, leaves), range(len(leaves))))


def deleted_message(name: str) -> str:
    return f"{name} was deleted (donated to another program?): pass a live array"


def prepared_call(run: Callable[[jax.Array], Any], name: str) -> Callable[[jax.Array], Any]:
    """`run(x)`, with a deleted `x` refused as `ValueError` naming `name` (nothing launched).

    For a `TowerProgram` call and an output wrapper, `TowerProgram.prepared` does the same
    with one frame less."""

    def call(x: jax.Array) -> Any:
        if not isinstance(x, jax.core.Tracer) and x.is_deleted():  # refused before any launch
            raise ValueError(deleted_message(name))
        return run(x)

    return call


class CallCache:
    """Prepared calls of one entry point, keyed by `call_key`: an LRU of `maxsize` signatures.

    Store only a call whose full checks passed for that key: a hit skips them. A kept call
    that holds something derived from the weights must be dropped (`clear()`) by the entry's
    `load_state`; one that reads the weights at call time (`TowerProgram.prepared`) need not.

    Args:
      maxsize: signatures kept, least recently used evicted first.
      checks: the entry's checks of its device input, each declared with `reads`: the key
        covers exactly their fields (default: shape, dtype, sharding and commitment; for
        `find_tree` also the structure, aliasing and options).
    """

    def __init__(self, maxsize: int = 64, *, checks: Iterable[Callable] | None = None):
        self._calls: PlanCache[Callable[[jax.Array], Any]] = PlanCache(maxsize)
        if checks is not None:
            checks = tuple(checks)
        self.fields = _ALL if checks is None else key_fields(checks)
        self._fields = _FULL if checks is None else _getter(self.fields)
        tree = TREE if checks is None else declared(checks)
        self.tree_fields = tuple(f for f in TREE if f in tree)
        self._structure, self._aliasing, self._options = (f in self.tree_fields for f in TREE)

    def find(self, x: Any, *metadata: Any) -> tuple[Callable[[jax.Array], Any] | None, Any]:
        """(the prepared call of this signature or None, the signature for `keep`)."""
        key = _key(self._fields, x, metadata)
        return (None if key is None else self._calls.peek(key)), key

    def find_tree(
        self, tree: Any, options: tuple = (), *metadata: Any
    ) -> tuple[Callable[..., Any] | None, Any]:
        """`find` for a call on a tree of device arrays (a dict of caches, a (src, dst) pair).

        The key is `(tree_key(tree, options), *metadata's content keys)`, or None when either
        part has none: its first part alone keys what depends on the arrays and options only.
        """
        part = self.tree_key(tree, options)
        if part is None:
            return None, None
        keys = [part]
        for m in metadata:  # inline: every repeated call runs it
            k = None if m is None else metadata_key(m)
            if k is None and m is not None:
                return None, None
            keys.append(k)
        key = tuple(keys)
        return self._calls.peek(key), key

    def tree_key(self, tree: Any, options: tuple = ()) -> Hashable | None:
        """Each leaf's declared fields and, as declared, the tree's structure, the pattern of
        leaves that are one array (`aliasing`) and `options` (scalars, by type and value).

        None when a leaf is not a live device array or an option is not a scalar."""
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if not set(map(type, leaves)) <= _LIVE_TYPES and not all(map(_live, leaves)):
            return None
        parts: list[Any] = [tuple(map(self._fields, leaves))]
        if self._structure:
            parts.append(treedef)
        if self._aliasing:
            parts.append(aliasing(leaves))
        if self._options:
            types = tuple(map(type, options))
            if not _SCALARS.issuperset(types):
                return None
            parts += (options, types)
        return tuple(parts)

    def keep(self, key: Hashable | None, run: Callable[[jax.Array], Any]) -> Callable:
        """Stores `run` under `find`'s signature (unless None) and returns it."""
        if key is not None:
            self._calls.put(key, run)
        return run

    def __len__(self) -> int:
        return len(self._calls)

    def clear(self) -> None:
        self._calls.clear()
