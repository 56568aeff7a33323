"""The server form of a benchmark row: a family's `forward` in a server's own jit.

`jaxsync.testing.server_step` is the jit (the state passed as its flat leaves, the module merged
inside); `server_runner` adds what a timed row needs: the plan's meta uploaded once and the
program compiled, both outside the timed call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

import jaxsync
from jaxsync.testing import server_step


def rows_only(forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward` returning only its rows (`Encoded.rows`), as a server that reads no extras."""

    def rows(model: Any, *inputs: Any) -> Any:
        return forward(model, *inputs).rows

    return rows


def server_runner(model: Any, forward: Callable[..., Any]) -> Callable[[Any, Callable], Callable]:
    """`(plan, next_input) -> run`: `run()` calls `forward(model, next_input(), meta)` in a
    server's own jit over the model's flat state leaves, `meta` the plan's, uploaded once.

    The first call runs here, so the program is compiled before the row is timed.
    """
    step, leaves = server_step(model, forward)

    def runner(plan: Any, next_input: Callable[[], Any]) -> Callable[[], Any]:
        meta = jaxsync.upload_packed(plan)

        def run() -> Any:
            return step(leaves, next_input(), meta)

        jax.block_until_ready(run())  # compile outside the timed region
        return run

    return runner
