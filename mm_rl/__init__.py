"""mm_rl: RL post-training (GRPO) for multimodal models on megatron-core, vLLM and Ray."""

__version__ = "0.1.0"
