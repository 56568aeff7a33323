"""`jaxsync bench SUBCOMMAND` at tiny sizes on any device: each one's help, a short run of each,
and the figures the benchmark page cites compare like with like. The plain `jaxsync bench`
keeps its options."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxsync._tower import TowerProgram
from jaxsync.harness import _cli
from jaxsync.harness.bench import _host_time, _roofline
from jaxsync.harness.bench._cli import SUBCOMMANDS


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_subcommand_help(name, capsys):
    assert _cli.main(["bench", name, "--help"]) == 0
    assert f"usage: jaxsync bench {name}" in capsys.readouterr().out


def test_plain_bench_keeps_its_options_and_lists_the_subcommands(capsys):
    assert _cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(o in out for o in ("--paths", "--sizes", "--jaxsync-only", *SUBCOMMANDS))
    if jax.default_backend() == "cpu":  # parsed as the plain form, then refused on CPU
        assert _cli.main(["bench", "--paths", "glm4v", "--sizes", "tiny"]) == 2
    assert _cli.main(["bench", "--no-such-option"]) == 2


def _cold_stream_lines(out: str) -> dict[str, tuple[float, float]]:
    rows = {}
    for line in out.splitlines():
        if " cold " in line and " stream " in line:
            name, rest = line.split(" cold ")
            cold, stream = rest.split(" stream ")
            rows[name.strip()] = (float(cold.split()[0]), float(stream.split()[0]))
    return rows


def test_host_time_entry_and_programs(capsys):
    assert _cli.main(["bench", "host-time", "entry", "--smoke", "--depths", "1"]) == 0
    assert _cli.main(["bench", "host-time", "programs", "--smoke"]) == 0
    rows = _cold_stream_lines(capsys.readouterr().out)
    entry_rows = {"entry", "its program", "do-nothing, same args", "do-nothing, leaves"}
    assert {f"depth  1  {name}" for name in entry_rows} <= set(rows)
    assert any(row.startswith("depth  1  program, ") and row.endswith(" leaves") for row in rows)
    assert {"do-nothing", "chain of 10 matmul + tanh", "200-step fori_loop", "sort"} <= set(rows)
    assert all(cold > 0 and stream > 0 for cold, stream in rows.values())


def test_host_time_entry_program_gets_the_entrys_own_arguments():
    tower, enc, mel = _host_time._voxtral(1, smoke=True)
    program, inputs = _host_time._program_inputs(enc, mel)
    assert inputs[0] is mel  # the device features as given, and the plan's packed metadata
    entry_out = enc(input_features=mel).embeddings
    direct = program._jitted(program.leaves, *inputs)[0]
    assert jnp.array_equal(entry_out, direct)  # same program, same arguments, same result
    # the unpacked twin the bench times: the tower's own leaves, the same rows
    stacked = TowerProgram(tower, program._forward, packed=False, **program._jit_kwargs)
    leaves = jax.tree.leaves(nnx.state(tower))
    assert program.packed and len(stacked.leaves) == len(leaves)
    assert all(a is b for a, b in zip(stacked.leaves, leaves, strict=True))
    assert stacked.num_state_args > program.num_state_args
    assert jnp.array_equal(stacked._jitted(stacked.leaves, *inputs)[0], direct)


def test_host_overhead_one_entry(capsys):
    argv = ["bench", "host-overhead", "--only", "kv.extract_kv", "--calls", "20", "--repeats", "1"]
    assert _cli.main(argv) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("kv.")]
    entry, floor = (float(v) for v in row.split()[1:3])
    assert entry > 0 and floor > 0


def test_upload_small_batches(capsys):
    assert _cli.main(["bench", "upload", "--smoke", "--no-voxtral", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    for path in ("device_put", "async_h2d", "ring", "ring DMA (jitted copy)"):
        assert f"  {path} " in out


def test_roofline_floor_is_its_parts():
    ms = _roofline.floor_ms(["--smoke", "--windows", "1"])
    assert {"layer matmuls, chained", "attention, jax xla", "floor"} <= set(ms)
    parts = ms["layer matmuls, chained"] + ms["attention, jax xla"]
    assert all(v > 0 for v in ms.values()) and ms["floor"] >= parts


def test_roofline_at_released_width_needs_a_gpu(capsys):
    if jax.default_backend() != "cpu":
        pytest.skip("an accelerator is present")
    assert _cli.main(["bench", "roofline"]) == 2
    assert "--smoke" in capsys.readouterr().out


def test_roofline_chain_does_every_layer_matmul():
    # the chain's FLOPs are the layers' matmul FLOPs the bench counts, attention excluded
    from jaxsync.harness.paths.voxtral.bench import encoder_flops
    from jaxsync.models.voxtral import VoxtralAudioConfig

    small = dataclasses.replace(VoxtralAudioConfig(), hidden_size=40, intermediate_size=160,
                                num_attention_heads=4, num_hidden_layers=1)  # fmt: skip
    _, chain = _roofline.layer_matmuls(small, 1, jnp.float32)
    one, two = (encoder_flops(dataclasses.replace(small, num_hidden_layers=n), 1) for n in (1, 2))
    per_layer = two - one  # one more layer: its matmuls and its attention
    assert chain == per_layer - _roofline.attention_flops(small, 1)


def test_profile_one_row(capsys):
    pytest.importorskip("torch")  # the bench rows are built with their torch baselines
    argv = ["bench", "profile", "--paths", "kv", "--size", "tiny", "--calls", "1", "--top", "1",
            "--rows", "[new numpy ids each call]"]  # fmt: skip
    assert _cli.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "device per call" in line]
    assert rows and all("[new numpy ids each call]" in row for row in rows)


def test_profile_classes_kernel_names():
    from jaxsync.harness.bench._profile import classify

    assert classify("cudnn_flash_attn_fwd") == "attention"
    assert classify("nvjet_hsh_gemm") == "matmul"
    assert classify("loop_convert_fusion") == "fusion"  # "convert" is not a convolution
    assert classify("something") == "other"


def test_render_a_saved_run(tmp_path):
    m = {"device_ms": 1.0, "blocked_ms": 0.01, "first_call_ms": 100.0}
    env = {"date": "d", "device": "X", "jax": "j", "torch": "t", "transformers": "h", "python": "3"}
    rows = [{"family": "kv", "size": "tiny", "name": "copy 64", "jaxsync": m}]
    result = {"environment": env, "copy_ceiling_gbps": {"jax": 1.0, "torch": 1.0}, "rows": rows}
    (tmp_path / "bench.json").write_text(json.dumps(result))
    out = tmp_path / "out"
    assert _cli.main(["bench", "render", str(tmp_path / "bench.json"), str(out)]) == 0
    assert "| copy 64 | jaxsync | 1.000 |" in (out / "bench.md").read_text()


def test_first_call_forms_run_the_same_forward():
    """Each form's child times a first call; the server form runs the entry's own forward on
    the entry's own inputs, in a server's jit, and gives the entry's rows."""
    import numpy as np

    from jaxsync.harness.bench import _first_call
    from jaxsync.models._bucket_inputs import bucket_inputs
    from jaxsync.testing import server_step

    tower, make = _first_call._encoder("glm4v", "tiny")
    enc = make()
    args, kwargs = bucket_inputs(enc).make(min(bucket_inputs(enc).default))
    expected = np.asarray(enc(*args, **kwargs).embeddings)
    from jaxsync._tower import TowerProgram

    saved = TowerProgram.__call__, TowerProgram.prepared
    try:
        _first_call._capture_program_calls()
        with pytest.raises(_first_call._Captured) as captured:
            make()(*args, **kwargs)
    finally:
        TowerProgram.__call__, TowerProgram.prepared = saved
    program, inputs = captured.value.program, captured.value.inputs
    step, leaves = server_step(tower, program._forward)
    rows = np.asarray(step(leaves, *inputs).rows)
    np.testing.assert_array_equal(rows[: expected.shape[0]], expected)


def test_first_call_runs_each_form_in_its_own_process(tmp_path, capsys):
    out = tmp_path / "first.json"
    argv = ["bench", "first-call", "--paths", "glm4v", "--size", "tiny", "--out", str(out)]
    assert _cli.main(argv) == 0
    rows = json.loads(out.read_text())
    assert [r["form"] for r in rows] == ["entry", "server"]
    assert all(r["first_call_s"][0] > 0 for r in rows)
    assert rows[1]["host_steps_s"] > 0 and rows[1]["jit_args"] > 4


def test_mesh_rows_at_each_model_size(tmp_path, capsys):
    """The voxtral tower (tiny: 4 heads, widths divisible by 4) split over 1, 2 and 4 "model"
    devices: no gather at any size, the pattern's all-reduces only once the weights are split."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (the tests force 8 CPU devices)")
    out = tmp_path / "mesh.json"
    argv = ["bench", "mesh", "--smoke", "--paths", "voxtral", "--model", "1", "2", "4",
            "--repeat", "3", "--calls", "2", "--out", str(out)]  # fmt: skip
    assert _cli.main(argv) == 0
    rows = {r["model"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == [1, 2, 4]
    for m, r in rows.items():
        assert r["collectives"]["all-gather"] == 0, (m, r["collectives"])
        assert (r["collectives"]["all-reduce"] > 0) == (m > 1), (m, r["collectives"])
        assert (r["split_leaves"] > 0) == (m > 1), m
        assert r["blocked_ms"] > 0 and r["stream_ms"] > 0 and r["trace_ms"] > 0, r
        # a tiny forward on a shared CPU is within the busy work's noise: it may read 0 here
        assert r["device_ms"] >= 0, r
    printed = capsys.readouterr().out
    assert "voxtral" in printed and "not a device time" in printed


def test_mesh_refuses_without_two_accelerators(monkeypatch, capsys):
    from jaxsync.harness.bench import _mesh

    monkeypatch.setattr(_mesh, "accelerator_count", lambda: 1)
    assert _cli.main(["bench", "mesh", "--paths", "voxtral"]) == 2
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert "need 2 or more" in line and "--smoke" in line


def test_profile_classes_collectives_first():
    from jaxsync.harness.bench._profile import classify

    assert classify("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "collective"
    assert classify("all-reduce-start.3") == "collective"  # not a "reduce" fusion
    assert classify("reduce-scatter.1") == "collective"
    assert classify("input_reduce_fusion") == "fusion"
