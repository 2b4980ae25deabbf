"""Data sets for GRPO training: the synthetic geo3k-style set (``mm_rl.data.synthetic``) for the tiny default.

Nothing heavy is imported here; import the submodules directly.
"""
