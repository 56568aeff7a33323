"""`tools/host_time.py` and `tools/roofline.py` at tiny sizes: what the benchmark page cites
runs, and each comparison compares like with like."""

import dataclasses
import importlib.util
from pathlib import Path

import jax.numpy as jnp


_TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, _TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_host_time_entry_and_programs(capsys):
    tool = _tool("host_time")
    tool.main(["entry", "--smoke", "--depths", "1"])
    tool.main(["programs", "--smoke"])
    lines = [line for line in capsys.readouterr().out.splitlines() if "cold" in line]
    names = {line.split("cold")[0].strip() for line in lines}
    assert {"depth  1  entry", "depth  1  its program", "depth  1  do-nothing, same args"} <= names
    assert {"do-nothing", "chain of 200 matmul + tanh", "200-step fori_loop", "sort"} <= names
    for line in lines:  # cold and stream host times, both positive
        cold, stream = (float(part.split()[0]) for part in line.split("cold")[1].split("stream"))
        assert cold > 0 and stream > 0


def test_host_time_entry_program_gets_the_entrys_own_arguments():
    tool = _tool("host_time")
    enc, mel = tool._voxtral(1, smoke=True)
    program, inputs = tool._program_inputs(enc, mel)
    assert inputs[0] is mel  # the device features as given, and the plan's packed metadata
    entry_out = enc(input_features=mel).embeddings
    direct = program._jitted(program.leaves, *inputs)[0]
    assert jnp.array_equal(entry_out, direct)  # same program, same arguments, same result


def test_roofline_floor_is_its_parts():
    tool = _tool("roofline")
    ms = tool.main(["--smoke", "--windows", "1"])
    assert {"layer matmuls, chained", "attention, jax xla", "floor"} <= set(ms)
    parts = ms["layer matmuls, chained"] + ms["attention, jax xla"]
    assert all(v > 0 for v in ms.values()) and ms["floor"] >= parts


def test_roofline_chain_does_every_layer_matmul():
    # the chain's FLOPs are the layers' matmul FLOPs the bench counts, attention excluded
    from jaxsync.harness.paths.voxtral.bench import encoder_flops
    from jaxsync.models.voxtral import VoxtralAudioConfig

    tool = _tool("roofline")
    small = dataclasses.replace(VoxtralAudioConfig(), hidden_size=40, intermediate_size=160,
                                num_attention_heads=4, num_hidden_layers=1)  # fmt: skip
    _, chain = tool.layer_matmuls(small, 1, jnp.float32)
    one, two = (encoder_flops(dataclasses.replace(small, num_hidden_layers=n), 1) for n in (1, 2))
    per_layer = two - one  # one more layer: its matmuls and its attention
    assert chain == per_layer - tool.attention_flops(small, 1)
