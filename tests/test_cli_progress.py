"""Progress of `jaxsync verify` (table, `--json`, `--lower-for`), `precompile` and the weight
loader: a `tqdm` bar on stderr naming the path and its stage; rows on stdout as paths finish."""

import json

import jax
import jax.numpy as jnp
import pytest
from tqdm import tqdm

from jaxsync.harness import _cli, registry
from jaxsync.weights import _progress


@pytest.fixture
def temp_path(monkeypatch):
    registry.load_all()

    def register(name, build):
        monkeypatch.setitem(registry._paths, name, registry.PathSpec(name, "test path", build))

    return register


def _case(checkpoint=None):
    return registry.PathCase(jax.jit(lambda x: x * 2), [(jnp.ones(3),), (jnp.zeros(3),)])


def test_json_output_stays_alone_on_stdout_with_progress_on_stderr(temp_path, capsys):
    temp_path("test.first", _case)
    assert _cli.main(["verify", "--paths", "test.first", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["paths"][0]["status"] in ("verified", "skipped")
    err = captured.err
    assert "jaxsync verify" in err and "1/1 [####" in err
    for stage in ("building", "static scans", "guarded calls", "dispatch probe"):
        assert f"test.first: {stage}" in err, err


def test_each_row_is_printed_as_soon_as_its_path_is_done(temp_path, capsys):
    seen_before_second = []

    def second(checkpoint):
        seen_before_second.append(capsys.readouterr().out)  # stdout so far
        return _case()

    temp_path("test.first", _case)
    temp_path("test.second", second)
    assert _cli.main(["verify", "--paths", "test.first", "test.second", "--no-probe"]) == 0
    (before,) = seen_before_second
    assert "test.first" in before and "test.second" not in before
    assert "test.second" in capsys.readouterr().out


def test_lower_for_shows_the_export_stage(capsys):
    assert _cli.main(["verify", "--lower-for", "tpu", "--paths", "core.table_gather"]) == 0
    captured = capsys.readouterr()
    assert "core.table_gather: exporting for tpu" in captured.err
    assert "exporting" not in captured.out and "1 of 1 paths lower" in captured.out


def test_precompile_bar(capsys):
    argv = ["precompile", "--paths", "core.table_gather", "--buckets", "8", "16"]
    assert _cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "precompile 2/2 [###" in captured.err and "core.table_gather bucket=16" in captured.err


def test_loader_progress_is_a_tqdm_bar_after_the_delay(monkeypatch, capsys):
    ticks = iter([0.0, 0.5, 3.0, 3.1, 3.2])
    monkeypatch.setattr(_progress, "clock", lambda: next(ticks))
    bar = _progress.Progress(4 << 20, enabled=True)
    bar.update(1 << 20)  # 0.5 s: still silent
    assert bar.bar is None and capsys.readouterr().err == ""
    bar.update(1 << 20)  # 3 s: the bar appears with everything read so far
    bar.update(2 << 20)
    bar.close()
    assert isinstance(bar.bar, tqdm)
    err = capsys.readouterr().err
    assert err.startswith("\rloading weights [") and err.endswith("\n")
    assert "100%" in err.splitlines()[-1] and "3 tensors" in err and "4.00M/4.00M" in err


def test_loader_progress_stays_silent_when_disabled(capsys):
    bar = _progress.Progress(10, enabled=False)
    bar.update(10)
    bar.close()
    assert capsys.readouterr().err == ""
