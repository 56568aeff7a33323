"""jaxsync.harness.paths: the verification and benchmark harness, one sub-package per family.

Each `jaxsync.harness.paths.<family>` registers its paths with `jaxsync.harness.registry` when
imported: `verify` (parity builders and `register_path`), `bench` (PyTorch baselines and
`register_bench`) and `reference` (the transformers / torch references). The model packages
(`jaxsync.models`, `jaxsync.kv`) never import this harness, and nothing here imports torch at
module level: torch and transformers are imported inside the functions that need them (the
`test` / `bench` extras install them).
"""
