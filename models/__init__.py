"""jaxsync.models: sync-free multimodal paths as jitted Flax NNX modules.

Families: chameleon, gemma3n, glm4v, qwen3_omni, voxtral (import each sub-package).

Shape vocabulary used in every docstring, einsum and `# [..]` comment:
  B = batch / items, T = tokens or frames, D = model dim, F = feature (mel) bins,
  N = query heads, K = kv heads, H = head dim, P = patches, C = channels / chunks, V = vocabulary.
"""
