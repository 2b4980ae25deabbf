"""Rollout engines: n sampled responses per prompt, with the log-probs of the sampled tokens.

``base`` holds the contract (``RolloutRequest`` -> ``RolloutOutput`` per request, ``RolloutEngine.generate`` /
``update_weights`` / ``sleep`` / ``wake_up``), ``bounds`` the policies for prompts and images an engine cannot take
as they are, ``vllm_engine`` and ``hf_engine`` the two backends (``generate_config.backend``) and ``engine_worker``
the Ray actor hosting either with a thread budget (and the engine's end of the weight sync, ``mm_rl.sync``).
Nothing here imports megatron; nothing heavy is imported here; import the submodules directly.
"""
