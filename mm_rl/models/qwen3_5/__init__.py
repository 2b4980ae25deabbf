"""Qwen3.5 (dense; hybrid Gated DeltaNet and gated full attention) as a model family."""
