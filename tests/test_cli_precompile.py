"""`jaxsync precompile` and `jaxsync.precompile`: compiled buckets that serve without recompiles."""

import numpy as np
import pytest

from jaxsync.harness import _cli, registry


def test_precompile_then_mixed_stream_does_not_recompile(capsys):
    import jaxsync
    from jaxsync.check import no_recompile
    from jaxsync.harness.paths.demo import table_gather

    (spec,) = registry.paths(["core.table_gather"])
    target = spec.build(None).target(spec.name)
    done = jaxsync.precompile([target], buckets=[8, 16, 32, 64])
    assert [c.bucket for c in done] == [8, 16, 32, 64]
    assert "precompile 4/4 [###" in capsys.readouterr().err
    rng = np.random.default_rng(0)
    with no_recompile():
        for n in rng.integers(1, 64, size=40):
            table_gather(rng.integers(0, 97, size=int(n)).tolist())


def test_without_precompile_a_new_bucket_recompiles():
    from jaxsync.check import RecompileError, no_recompile
    from jaxsync.harness.paths.demo import table_gather

    with pytest.raises(RecompileError), no_recompile():
        table_gather(list(range(90)))  # bucket 128 was never compiled


def test_precompile_a_registered_encoder_by_its_target():
    # A registered path's case as a Target: its own buckets and inputs, the instance it serves.
    import jaxsync
    from jaxsync.check import no_recompile

    (spec,) = registry.paths(["glm4v.vision_tower"])
    case = spec.build(None)
    done = jaxsync.precompile([case.target("tower")], buckets=[24, 32], progress=False)
    assert [(c.path, c.bucket) for c in done] == [("tower", 24), ("tower", 32)]
    with no_recompile():
        case.fn(*case.make_inputs(32))


def test_precompile_command(capsys):
    assert _cli.main(["precompile", "--paths", "core.table_gather", "--buckets", "8", "16"]) == 0
    assert "2 program(s) compiled" in capsys.readouterr().out
    assert _cli.main(["precompile", "--paths", "nope"]) == 2
