"""Chameleon's image-token logit mask: a scatter of the image ids (the implementation before
2026-11-29 19:35 UTC) against the current `jnp.where` over a cached boolean column mask
(exploration, not a test).

  python tools/explore_mask.py [--tiny]

Prints device and host-blocked ms per forward (jaxsync.bench timing, donated chains, bf16 logits
[T, 65536], 8192 image ids) for an `.at[..., ids].set` scatter, the production `jnp.where`
over a [V] bool mask, and torch's `index_fill_` (vLLM post-PR) where torch has a GPU; and
checks that the two JAX fills are bit-identical.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxsync.bench._timing import _Side, measure
from jaxsync.models.chameleon import _reference as ref
from jaxsync.models.chameleon._config import ChameleonConfig, ChameleonVQConfig
from jaxsync.models.chameleon._logits import _mask_donated
from jaxsync.models.chameleon._model import ChameleonImagePaths


def main() -> None:
    vocab, n_codes = (4099, 97) if "--tiny" in sys.argv else (65536, 8192)
    vq = ChameleonVQConfig(num_embeddings=n_codes)
    cfg = ChameleonConfig(vocab_size=vocab, vocabulary_map=ref.synth_vocab_map(n_codes), vq=vq)
    ids_host = ChameleonImagePaths(cfg).mapping.image_token_ids
    dev = jax.devices()[0]
    ids = jax.device_put(ids_host, dev)
    mask = jax.device_put(np.isin(np.arange(vocab), ids_host), dev)  # [V] bool

    def _scatter(x, ids):  # ids sorted, unique, in range
        return x.at[..., ids].set(
            jnp.finfo(x.dtype).min,
            indices_are_sorted=True,
            unique_indices=True,
            mode="promise_in_bounds",
        )

    scatter, where = jax.jit(_scatter, donate_argnums=0), _mask_donated
    side = _Side("jax")
    torch_side = None
    try:
        import torch

        if torch.cuda.is_available():
            torch_side = _Side("torch")
    except ImportError:
        pass
    for tokens in (1, 16, 64, 256):
        x = jax.random.normal(jax.random.key(tokens), (tokens, vocab), jnp.bfloat16)
        a, b = scatter(x.copy(), ids), where(x.copy(), mask)
        same = bool(jnp.array_equal(a.view(jnp.uint16), b.view(jnp.uint16)))
        row = [f"T={tokens:3d} bit-identical={same}"]
        for name, fn, arg in (("scatter", scatter, ids), ("where", where, mask)):
            state = {"x": x.copy()}  # a fresh buffer: the chain donates it

            def run(fn=fn, arg=arg, state=state):
                state["x"] = fn(state["x"], arg)
                return state["x"]

            m = measure(run, side)
            row.append(f"{name} {m['device_ms']:.4f} / {m['blocked_ms']:.3f}")
        if torch_side is not None:
            tx = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16)
            idx = torch.as_tensor(ids_host, dtype=torch.long, device="cuda")
            fill = torch.finfo(torch.bfloat16).min
            m = measure(lambda tx=tx, idx=idx, f=fill: tx.index_fill_(1, idx, f), torch_side)
            row.append(f"index_fill_ {m['device_ms']:.4f} / {m['blocked_ms']:.3f}")
        print(" | ".join(row) + "   (device / host-blocked ms)")


if __name__ == "__main__":
    main()
