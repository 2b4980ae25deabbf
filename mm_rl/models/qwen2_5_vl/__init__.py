"""Qwen2.5-VL: its tensor table, model.json from config.json and rules (``family``), its tiny model (``tiny``).
The model itself is the shared Qwen-VL stage (``mm_rl.models.qwen_vl``)."""
