"""jaxsync.harness: what proves and measures the runtime, apart from what servers import.

- `jaxsync.harness.paths`: one sub-package per family: parity builders (`verify`), PyTorch
  baselines (`bench`) and transformers references (`reference`), plus the demo path.
- `jaxsync.harness.registry`: the paths and benchmarks `jaxsync verify` / `jaxsync bench` run.
- `jaxsync.harness.bench`: `jaxsync bench` (timings, programs, rendered tables).
- `_cli`, `_cli_verify`, `_verify_table`: the `jaxsync` command.

The runtime (`jaxsync`'s core, `jaxsync.models`, `jaxsync.kv`, `jaxsync.check`,
`jaxsync.weights`) never imports this package; torch and transformers are imported here only
inside the functions that need them.
"""
