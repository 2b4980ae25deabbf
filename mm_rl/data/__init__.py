"""Data sets for GRPO training: the readers (verl / MindSpeed parquet, raw geometry3k, jsonl) and the prompt
sampler. The synthetic set of the tiny demo is ``mm_rl.demo.synthetic``.

Nothing heavy is imported here; import the submodules directly.
"""
