"""Every ```python block of README.md and docs/*.md runs as written.

The blocks of one file run in order in one namespace, so a block may use names an earlier block
of the same file defined. Names the docs take from the reader's own program (an image processor
and its images, a server's caches, an entry point and its arguments) come from `_context`, each
a tiny real object. Checkpoint paths the docs use as placeholders map to tiny checkpoints built
here (`CHECKPOINTS`). Blocks that cannot run here are listed in `SKIP`, keyed by their first
line, each with the reason. Where torch or transformers is missing (Python >= 3.12), the blocks
that need them, and the later blocks of that file that use their names, are skipped.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsync
from jaxsync import check, kv
from jaxsync.harness import registry


ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)

# Placeholder checkpoint path in the docs -> the family whose tiny checkpoint stands in for it.
CHECKPOINTS = {"/ckpt/GLM-4.1V-9B": "glm4v"}

# First line of a block -> why it does not run here. Keep this short.
SKIP: dict[str, str] = {
    # needs one process per host: tests/test_distributed.py runs it through run_distributed
    "# every process of the run, before any other jax call (one process per host)": (
        "jax.distributed across processes"
    ),
}


def _blocks(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(1)) for m in _BLOCK.finditer(text)]


def _tiny_glm4v_checkpoint(folder: Path) -> str:
    from jaxsync.harness.paths.glm4v import reference as ref

    ref.hf_config(**ref.TINY).to_json_file(str(folder / "config.json"))
    ref.save_checkpoint(
        ref.build_reference(ref.hf_config(**ref.TINY)), folder / "model.safetensors"
    )
    return str(folder)


def _image_processor():
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    from jaxsync.harness.paths.glm4v import reference as ref

    tiny = ref.TINY
    return Glm4vImageProcessorPil(
        patch_size=tiny["patch_size"],
        temporal_patch_size=tiny["temporal_patch_size"],
        merge_size=tiny["spatial_merge_size"],
        size={"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 64},
    )


def _context() -> dict:
    """The reader's own names the docs' blocks use, as tiny real objects."""
    small = kv.KVLayout(kind="packed", num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
    caches = small.random(["layer0", "layer1"], jax.random.key(0))
    f = jax.jit(lambda ids, table: table[ids])
    table = jnp.arange(16.0)
    rng = np.random.default_rng(0)
    names = dict(
        jax=jax, jnp=jnp, np=np, nnx=nnx, functools=functools, jaxsync=jaxsync, check=check, kv=kv,
        # README, "The core": a host table, ids and metadata, an entry point and its arguments.
        build_table=lambda: np.arange(16, dtype=np.float32) ** 2,
        block_ids=[3, 1, 2],
        ids_np=np.array([4, 5, 6], np.int32),
        lens_np=np.array([2, 1], np.int32),
        entry_fn=f,
        args=(jnp.array([1, 2], jnp.int32), table),
        more_args=(jnp.array([3, 0], jnp.int32), table),
        # README, "KV cache paths": a server's per-layer caches and a copy-on-write pair.
        server_caches=caches,
        src_ids=[0, 1],
        dst_ids=[2, 3],
        # docs/serving.md: a server's per-layer cache, this step's slots and its own metadata.
        cache=caches,
        slots=[0, 5, 9],
        request_fields={"positions": np.arange(3, dtype=np.int32)},
        # README, "The API at a glance": the processor's images.
        images=[rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for h, w in [(50, 70), (33, 33)]],
    )  # fmt: skip
    try:
        names["image_processor"] = _image_processor()
    except ImportError:  # no transformers: the blocks using it are skipped
        pass
    return names


def _needs_torch(source: str) -> bool:
    return any(p in source for p in CHECKPOINTS) or "image_processor" in source


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Placeholder path -> tiny checkpoint folder (empty where torch is missing)."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return {}
    builders = {"glm4v": _tiny_glm4v_checkpoint}
    return {p: builders[f](tmp_path_factory.mktemp(f)) for p, f in CHECKPOINTS.items()}


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_python_blocks_run_as_written(path, checkpoints, monkeypatch):
    # A block showing how to register a path must not collide with the registered ones.
    monkeypatch.setattr(registry, "_paths", {})
    namespace = _context()
    skipped, defined_by_skipped = [], False
    for line, source in _blocks(path):
        first = source.strip().splitlines()[0] if source.strip() else ""
        where = f"{path.name}:{line} ({first!r})"
        if first in SKIP:
            skipped.append(f"{where}: {SKIP[first]}")
            continue
        if _needs_torch(source) and not checkpoints:
            skipped.append(f"{where}: needs torch and transformers")
            defined_by_skipped = True
            continue
        for placeholder, folder in checkpoints.items():
            source = source.replace(placeholder, folder)
        try:
            exec(compile(source, where, "exec"), namespace)
        except NameError as e:
            if not defined_by_skipped:
                pytest.fail(f"{where} failed: {e!r}")
            skipped.append(f"{where}: uses a name of a skipped block ({e})")
        except Exception as e:
            pytest.fail(f"{where} failed: {type(e).__name__}: {e}")
    if skipped:
        print("\n".join(["skipped blocks:", *skipped]))
