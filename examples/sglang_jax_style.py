"""An sglang-jax-style model class around jaxsync's Qwen3-Omni audio encoder.

sglang-jax builds a model as an `nnx.Module(config, dtype, mesh)`, keeps it as
`nnx.split(model)` with the state flattened to leaves, and embeds each multimodal request once,
before prefill, in `jitted_embed_mm(model_def, model_state_def, model_state_leaves, input_ids,
<image pixels, grid, video pixels, grid, audio features, audio lengths>, ...)`, a `jax.jit` of
the model's `embed_mm` whose grids and audio lengths are static arguments. `embed_mm` returns
`(fused [S, D], deepstack, visual_pos_mask)`: the text embeddings with every placeholder row
replaced, in order, by one concatenated `[N, D]` array per modality (`mm_core.merge`'s rule).
Its mesh axes are ("data", "tensor"). This example does exactly that with a tiny random
Qwen3-Omni audio tower whose weights are sharded by jaxsync's partition rules, renamed from
"model" to "tensor", and checks:

- the audio rows equal `Qwen3OmniAudioEncoder`'s, the other rows the text embedding table's;
- after one warm-up call, further calls compile nothing and read nothing back;
- new state leaves in the runner are seen by the next call without recompiling;
- with the plan made on the host and passed in (the lengths no longer static), two length mixes
  in one bucket share one program.

  python examples/sglang_jax_style.py
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxsync
from jaxsync.check import no_recompile, sync_guard
from jaxsync.harness.paths.qwen3_omni.reference import TINY, random_features
from jaxsync.models import qwen3_omni
from jaxsync.weights import PartitionRules, partition_spec


VOCAB = 97
AUDIO_TOKEN_ID = 5  # the prompt's audio placeholder id
SEQ_BUCKET = 64  # prompts padded to a multiple, as sglang-jax pads them when it buckets


class Qwen3OmniAudioPrompt(nnx.Module):
    """The part of an sglang-jax Qwen3-Omni model class that embeds a prompt with its audios."""

    def __init__(self, config: qwen3_omni.Qwen3OmniAudioConfig, dtype=None, mesh=None):
        self.mesh = mesh
        dtype = dtype or jnp.float32
        rngs = nnx.Rngs(0)  # eval_shape abstracts it away when the server loads weights
        kw = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.audio_tower = qwen3_omni.Qwen3OmniAudioTower(config, **kw)
        self.embed_tokens = nnx.Embed(VOCAB, config.output_dim, **kw)
        self.audio_token_id = AUDIO_TOKEN_ID

    def encode_audio(self, input_features, feature_lens, meta=None):
        """[F, T] features of all audios + lengths -> [R, D] rows, real tokens first in order.

        sglang-jax passes `feature_lens` as a static tuple, so the plan can be made while
        tracing: its fields become constants of the program (one per length mix, as today).
        A runner that plans on the host instead passes `meta` and the lengths stay dynamic.
        """
        if meta is None:
            plan = qwen3_omni.plan(
                feature_lens, self.audio_tower.cfg, num_frames=input_features.shape[1]
            )
            meta = jaxsync.upload_packed(plan, placement=_replicated(self.mesh))
        return qwen3_omni.forward(self.audio_tower, input_features, meta).rows

    def embed_mm(
        self,
        input_ids,
        mm_pixel_values=None,
        mm_grid_thw=None,
        mm_pixel_values_videos=None,
        mm_video_grid_thw=None,
        mm_audio_features=None,
        mm_audio_feature_lengths=None,
        mm_audio_codes=None,
        mm_real_llm_dims=None,
        mm_real_video_llm_dims=None,
        mm_audio_meta=None,
    ):
        """[S] ids -> (fused [S, D], deepstack None, visual_pos_mask None): sglang-jax's tuple.

        The arguments are sglang-jax's; `mm_audio_meta` is the planned form's one addition.
        """
        del mm_pixel_values, mm_grid_thw, mm_pixel_values_videos, mm_video_grid_thw  # audio only
        del mm_audio_codes, mm_real_llm_dims, mm_real_video_llm_dims  # other models' inputs
        text = self.embed_tokens(input_ids)  # [S, D]
        mod_embeds, placeholder_ids = [], []
        if mm_audio_features is not None:
            rows = self.encode_audio(mm_audio_features, mm_audio_feature_lengths, mm_audio_meta)
            mod_embeds.append(rows)
            placeholder_ids.append(self.audio_token_id)
        return merge(text, mod_embeds, placeholder_ids, input_ids, mesh=self.mesh), None, None


def merge(text_embed, mod_embeds, pad_values, input_ids, *, mesh=None):
    """sglang-jax's `mm_core.merge(...).embed`: the k-th placeholder row takes row k of the
    modalities' rows in order; slots past the placeholder count (here the tower's padding rows)
    point one past the end and are dropped. Operands are replicated first on a mesh."""
    if not mod_embeds:
        return text_embed
    rows = jnp.concatenate(mod_embeds, axis=0)
    if mesh is not None:
        text_embed = jax.lax.with_sharding_constraint(text_embed, _replicated(mesh))
        rows = jax.lax.with_sharding_constraint(rows, _replicated(mesh))
    placeholder = jnp.isin(input_ids, jnp.asarray(pad_values, input_ids.dtype))
    positions = jnp.nonzero(placeholder, size=rows.shape[0], fill_value=text_embed.shape[0])[0]
    return text_embed.at[positions, :].set(rows, mode="drop")  # at the text embedding's dtype


def _replicated(mesh: Mesh | None):
    return None if mesh is None else NamedSharding(mesh, PartitionSpec())


@functools.partial(
    jax.jit,
    static_argnames=[
        "model_state_def",
        "mm_grid_thw",
        "mm_video_grid_thw",
        "mm_audio_feature_lengths",
    ],
)
def jitted_embed_mm(
    model_def,
    model_state_def,
    model_state_leaves,
    input_ids,
    mm_pixel_values,
    mm_grid_thw,
    mm_pixel_values_videos,
    mm_video_grid_thw,
    mm_audio_features,
    mm_audio_feature_lengths,
    mm_real_llm_dims=None,
    mm_real_video_llm_dims=None,
    mm_audio_codes=None,
    mm_audio_meta=None,
):
    # sglang-jax's encode jit: the leaves are arguments, so new weights need no recompile.
    model = nnx.merge(model_def, jax.tree_util.tree_unflatten(model_state_def, model_state_leaves))
    return model.embed_mm(
        input_ids,
        mm_pixel_values,
        mm_grid_thw,
        mm_pixel_values_videos,
        mm_video_grid_thw,
        mm_audio_features,
        mm_audio_feature_lengths,
        mm_real_llm_dims=mm_real_llm_dims,
        mm_real_video_llm_dims=mm_real_video_llm_dims,
        mm_audio_codes=mm_audio_codes,
        mm_audio_meta=mm_audio_meta,
    )


def rename_axis(rules: PartitionRules, old: str, new: str) -> PartitionRules:
    """A partition-rule table with mesh axis `old` renamed to `new` (e.g. "model" -> "tensor")."""

    def entry(e):
        if isinstance(e, str):
            return new if e == old else e
        return None if e is None else tuple(new if n == old else n for n in e)

    return tuple(
        (regex, None if axes is None else tuple(map(entry, axes))) for regex, axes in rules
    )


def shard(model: nnx.Module, mesh: Mesh, rules: PartitionRules) -> None:
    """Places every parameter by the first rule whose regex matches its path (else replicated).

    A rule's axes describe one layer: inside a `jaxsync.LayerStack` the leading layer axis is
    kept unsharded in front of them.
    """
    stacks = [p for p, node in nnx.iter_graph(model) if isinstance(node, jaxsync.LayerStack)]
    state = nnx.state(model)
    flat = []
    for path, var in nnx.to_flat_state(state):
        name = ".".join(str(p) for p in path)
        axes = next((a for regex, a in rules if re.search(regex, name)), None)
        value = var.get_value()
        if any(tuple(path[: len(s)]) == tuple(s) for s in stacks):
            spec = PartitionSpec(None, *partition_spec(axes, value.shape[1:], mesh))
        else:
            spec = partition_spec(axes, value.shape, mesh)
        flat.append((path, var.replace(jax.device_put(value, NamedSharding(mesh, spec)))))
    nnx.update(model, nnx.from_flat_state(flat))


def _prompt(tokens_per_audio, rng) -> np.ndarray:
    """Text, each audio's placeholders between text, padded with id 0 to a `SEQ_BUCKET` multiple."""
    ids = []
    for n in tokens_per_audio:
        ids += rng.integers(AUDIO_TOKEN_ID + 1, VOCAB, 3).tolist() + [AUDIO_TOKEN_ID] * n
    ids += rng.integers(AUDIO_TOKEN_ID + 1, VOCAB, 2).tolist()
    return np.pad(np.asarray(ids, np.int32), (0, -len(ids) % SEQ_BUCKET))


def _check(fused, ids, embedding, expected) -> None:
    """The placeholder rows hold the entry's rows in order; every other row is its text row.

    The entry's program is the audio forward alone; the runner's jit fuses it with the text
    embedding and the scatter, so XLA may fuse them differently: the rows agree to float32
    rounding, not always bit for bit.
    """
    fused, audio = np.asarray(fused), ids == AUDIO_TOKEN_ID
    want = np.concatenate(expected.split())
    np.testing.assert_allclose(fused[audio], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(fused[~audio], np.asarray(embedding)[ids[~audio]])


def main() -> None:
    tensor = min(2, jax.device_count())  # 2-way tensor parallel where the host has the devices
    mesh = Mesh(np.array(jax.devices()[:tensor]).reshape(1, tensor), ("data", "tensor"))
    model = Qwen3OmniAudioPrompt(TINY, mesh=mesh)
    shard(model, mesh, rename_axis(qwen3_omni.PARTITION_RULES, "model", "tensor"))
    q_kernel = model.audio_tower.layers.layer.self_attn.q_proj.kernel[...]  # [L, D, D]
    assert q_kernel.sharding.spec == PartitionSpec(None, None, "tensor"), q_kernel.sharding
    model_def, state = nnx.split(model)
    leaves, state_def = jax.tree_util.tree_flatten(state)
    entry = qwen3_omni.Qwen3OmniAudioEncoder(model.audio_tower)
    rng, repl = np.random.default_rng(0), _replicated(mesh)

    lens = (150, 37)  # sglang-jax: per-audio mel frames, a static tuple
    tokens = qwen3_omni.feat_extract_output_lengths(lens, TINY.n_window).tolist()
    ids = _prompt(tokens, rng)
    input_ids = jaxsync.async_h2d(ids, placement=repl)
    features = jaxsync.async_h2d(random_features(TINY, lens), placement=repl)  # [F, sum(lens)]

    def embed(leaves, features, lens, meta=None):
        # the runner's call, images and videos absent (None)
        return jitted_embed_mm(
            model_def, state_def, leaves, input_ids, None, None, None, None, features, lens,
            mm_audio_meta=meta,
        )  # fmt: skip

    first, _, _ = embed(leaves, features, lens)  # warm-up
    halved = [w * 0.5 for w in leaves]  # new weights, as an update of the runner's leaves
    with sync_guard("error"), no_recompile():
        again, _, _ = embed(leaves, features, lens)
        updated, _, _ = embed(halved, features, lens)
    _check(first, ids, model.embed_tokens.embedding[...], entry(features, lens))
    np.testing.assert_array_equal(again, first)
    assert not np.allclose(updated, first), "the updated weights were not used"

    # Planned on the host: padded to the plan's frame bucket, the lengths leave the program's key.
    mixes = [(150, 37), (120, 61)]
    uploads = []
    for mix in mixes:
        plan = qwen3_omni.plan(mix, TINY)
        host = qwen3_omni.pad_features(random_features(TINY, mix, seed=sum(mix)), mix)
        assert host.shape[1] == plan.num_frames
        feats = jaxsync.async_h2d(host, placement=repl)
        uploads.append((feats, jaxsync.upload_packed(plan, placement=repl), plan))
    (feats_a, meta_a, _), (feats_b, meta_b, plan_b) = uploads
    embed(leaves, feats_a, None, meta_a)  # warm-up of the bucket's one program
    ids_b = _prompt(plan_b.lengths, rng)
    assert ids_b.shape == ids.shape, "the example's prompts share one sequence bucket"
    input_ids = jaxsync.async_h2d(ids_b, placement=repl)
    with sync_guard("error"), no_recompile():
        mixed, _, _ = embed(leaves, feats_b, None, meta_b)
    _check(mixed, ids_b, model.embed_tokens.embedding[...], entry(feats_b, mixes[1]))
    print(
        f"{len(lens)} audios -> {sum(tokens)} rows merged into a {ids.shape[0]}-token prompt on a "
        f"{dict(mesh.shape)} mesh; 0 compiles and 0 host reads after warm-up; a state update is "
        "seen without recompiling; a planned length mix shares the bucket's program"
    )


if __name__ == "__main__":
    main()
