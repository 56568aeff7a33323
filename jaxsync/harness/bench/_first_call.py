"""First call of each call form, each in a fresh process: compile included, nothing shared.

A server pays its first call once per program, so the comparison is only honest when neither
form inherits the other's compiled programs, autotuning or runtime start-up. Each (family, form)
runs in its own process, which builds the family's tower (random weights), takes one host input
of the family's bucket (`models/_bucket_inputs.py`) and times:

  entry   `Encoder(model)` built, then `encoder(*host input)` until its rows are ready: checks,
          plan, one upload, staging, compile and run.
  server  the same host input through the entry's host steps up to the program call (its checks,
          plan, upload and staging), then the family's `forward` in a server's own `jax.jit` over
          the tower's flat state leaves (`jaxsync.testing.server_step`), compile and run.

    jaxsync bench first-call                             # every family, released sizes
    jaxsync bench first-call --paths glm4v --size tiny --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any


FAMILIES = ("glm4v", "qwen3_omni", "voxtral", "gemma3n", "chameleon")
FORMS = ("entry", "server")
# The bucket each family is timed at: the smallest default bucket at least this large
# (glm4v: merged tokens of one 336² image; audio: 30 s of frames; voxtral: windows; images).
_TARGET = {"glm4v": 144, "qwen3_omni": 3000, "gemma3n": 3000, "voxtral": 4, "chameleon": 4}


def _encoder(family: str, size: str) -> tuple[Any, Callable[[], Any]]:
    """`(tower, make_encoder)` of `family` at `size` ("tiny" fp32, "released" bf16), random
    weights."""
    import jax.numpy as jnp
    from flax import nnx

    dtype = jnp.float32 if size == "tiny" else jnp.bfloat16
    kw = dict(rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    if family == "glm4v":
        from jaxsync.harness.paths.glm4v import reference as ref
        from jaxsync.models.glm4v import (
            Glm4vVisionConfig as Cfg,
            Glm4vVisionEncoder as Enc,
            Glm4vVisionTower as Tower,
        )

        cfg = Cfg(**ref.TINY) if size == "tiny" else Cfg.from_hf_config(ref.hf_config())
        tower = Tower(cfg, rngs=kw["rngs"], dtype=dtype)
        return tower, lambda: Enc(tower)
    if family == "qwen3_omni":
        from jaxsync.harness.paths.qwen3_omni import reference as ref
        from jaxsync.models.qwen3_omni import Qwen3OmniAudioEncoder, Qwen3OmniAudioTower

        tower = Qwen3OmniAudioTower(ref.TINY if size == "tiny" else ref.RELEASED, **kw)
        return tower, lambda: Qwen3OmniAudioEncoder(tower)
    if family == "voxtral":
        from jaxsync.harness.paths.voxtral import reference as ref
        from jaxsync.models.voxtral import (
            MelConfig,
            VoxtralAudioConfig,
            VoxtralAudioEncoder,
            VoxtralAudioTower,
        )

        if size == "tiny":
            cfg = VoxtralAudioConfig(**ref.TINY_ENCODER)
        else:
            from transformers import VoxtralConfig

            text = {"model_type": "llama", **ref.TINY_TEXT, "hidden_size": 3072, "head_dim": 128}
            cfg = VoxtralAudioConfig.from_hf_config(VoxtralConfig(text_config=text))
        tower = VoxtralAudioTower(cfg, **kw)
        mel = MelConfig(num_mel_bins=cfg.num_mel_bins)
        return tower, lambda: VoxtralAudioEncoder(tower, mel)
    if family == "gemma3n":
        from jaxsync.harness.paths.gemma3n import reference as ref
        from jaxsync.models.gemma3n import Gemma3nAudioEncoder, Gemma3nAudioModel, from_hf_config

        cfg = ref.tiny_config() if size == "tiny" else from_hf_config(ref.hf_config("released"))
        model = Gemma3nAudioModel(cfg, **kw)
        return model, lambda: Gemma3nAudioEncoder(model)
    if family == "chameleon":
        from jaxsync.harness.paths.chameleon import reference as ref
        from jaxsync.models.chameleon import (
            ChameleonConfig,
            ChameleonImageEncoder,
            ChameleonImageTower,
        )

        vq = ref.tiny_vq_config() if size == "tiny" else {}
        codes = vq.get("num_embeddings", 8192)
        hf = {"vocabulary_map": ref.synth_vocab_map(codes, seed=0), "vq_config": vq}
        tower = ChameleonImageTower(ChameleonConfig.from_hf_config(hf), **kw)
        return tower, lambda: ChameleonImageEncoder(tower)
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


class _Captured(Exception):
    """Raised in place of the entry's program call, carrying the program and its inputs."""

    def __init__(self, program: Any, inputs: tuple):
        super().__init__("captured")
        self.program, self.inputs = program, inputs


def _capture_program_calls() -> None:
    """Every `TowerProgram` call raises `_Captured` instead of compiling (server form only)."""
    from jaxsync._tower import TowerProgram

    def call(self, *inputs):
        raise _Captured(self, inputs)

    def prepared(self, *rest, finish, name):
        return lambda x: call(self, x, *rest)

    TowerProgram.__call__ = call
    TowerProgram.prepared = prepared


def _programs_leaves(enc: Any) -> list:
    """The state leaves of every `TowerProgram` an encoder holds (directly or in an entry)."""
    from jaxsync._tower import TowerProgram

    found = []
    for value in vars(enc).values():
        for obj in (value, *vars(value).values()) if hasattr(value, "__dict__") else (value,):
            if isinstance(obj, TowerProgram):
                found.append(obj.leaves)
    return found


def _bucket_input(enc: Any, family: str, size: str) -> tuple[int, tuple, dict]:
    """`(bucket, args, kwargs)`: the bucket `family` is timed at and one host input of it."""
    from jaxsync.models._bucket_inputs import bucket_inputs

    spec = bucket_inputs(enc)
    bucket = min((b for b in spec.default if b >= _TARGET[family]), default=max(spec.default))
    if size == "tiny":
        bucket = min(spec.default)
    return (bucket, *spec.make(bucket))


def _program_call(enc: Any, family: str, args: tuple, kwargs: dict) -> _Captured:
    """The `TowerProgram` call `enc(*args, **kwargs)` reaches, once program calls are captured
    (`_capture_program_calls`): the entry's host steps run, nothing compiles."""
    try:
        enc(*args, **kwargs)
    except _Captured as c:
        return c
    raise RuntimeError(f"{family}'s entry ran no TowerProgram: nothing to time")


def _rows(out: Any) -> Any:
    rows = getattr(out, "rows", None)
    return rows if rows is not None else getattr(out, "embeddings", out)


def child(family: str, form: str, size: str) -> dict[str, Any]:
    """One form's first call in this (fresh) process."""
    import jax
    from flax import nnx

    from jaxsync.testing import server_step

    jax.config.update("jax_default_matmul_precision", "default")  # serving precision
    t0 = time.perf_counter()
    tower, make_encoder = _encoder(family, size)
    jax.block_until_ready(nnx.state(tower))
    t1 = time.perf_counter()
    enc = make_encoder()  # the entry's own copy of the weights (packed) is made here
    jax.block_until_ready(_programs_leaves(enc))
    built, enc_built = t1 - t0, time.perf_counter() - t1
    bucket, args, kwargs = _bucket_input(enc, family, size)
    result = {
        "family": family,
        "form": form,
        "size": size,
        "bucket": bucket,
        "build_s": built,
        "encoder_build_s": enc_built,
    }
    if form == "entry":
        t0 = time.perf_counter()
        jax.block_until_ready(_rows(enc(*args, **kwargs)))
        result["first_call_s"] = time.perf_counter() - t0
        return result
    _capture_program_calls()
    t0 = time.perf_counter()
    captured = _program_call(enc, family, args, kwargs)
    host_steps = time.perf_counter() - t0
    program = captured.program
    if nnx.graphdef(tower) != program.graphdef:
        raise RuntimeError(f"{family}'s program is not over the tower built here")
    t1 = time.perf_counter()
    step, leaves = server_step(tower, program._forward)
    jax.block_until_ready(_rows(step(leaves, *captured.inputs)))
    result["host_steps_s"] = host_steps
    result["first_call_s"] = host_steps + time.perf_counter() - t1
    result["jit_args"] = len(leaves) + len(jax.tree_util.tree_leaves(captured.inputs))
    return result


def main(argv: list[str] | None = None) -> int:
    description = __doc__.split("\n")[0]
    ap = argparse.ArgumentParser(prog="jaxsync bench first-call", description=description)
    ap.add_argument("--paths", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--forms", nargs="*", default=list(FORMS), choices=FORMS)
    ap.add_argument("--size", default="released", choices=("tiny", "released"))
    ap.add_argument("--repeats", type=int, default=1, help="fresh processes per form (median)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--child", nargs=2, metavar=("FAMILY", "FORM"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.size)), flush=True)
        return 0
    client = "tfrt" if os.environ.get("XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT") else "default"
    print(f"first call in a fresh process per form ({client} client, {args.size} sizes)")
    print(f"  {'family':<12}{'form':<8}{'bucket':>8}{'first call s':>14}{'of it host s':>14}")
    results, failed = [], 0
    for family in args.paths:
        for form in args.forms:
            runs = []
            for _ in range(args.repeats):
                cmd = [sys.executable, "-m", "jaxsync", "bench", "first-call", "--size", args.size]
                proc = subprocess.run(
                    [*cmd, "--child", family, form], capture_output=True, text=True
                )
                lines = proc.stdout.strip().splitlines()
                if proc.returncode or not lines:
                    failed += 1
                    print(f"  {family:<12}{form:<8} failed: {proc.stderr.strip()[-400:]}")
                    break
                runs.append(json.loads(lines[-1]))
            if not runs:
                continue
            row = dict(runs[0], client=client, first_call_s=[r["first_call_s"] for r in runs])
            first = statistics.median(row["first_call_s"])
            host = statistics.median(r.get("host_steps_s", 0.0) for r in runs)
            print(f"  {family:<12}{form:<8}{row['bucket']:>8}{first:>14.2f}{host:>14.3f}")
            results.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 1 if failed else 0
