"""GRPO-family algorithms as pure torch functions: no framework state, no distributed calls, no config loading.

One concern per module:

- ``masked``: reductions over a 0/1 response mask (sum, mean, variance, whitening, summary statistics);
- ``token_level``: sequence values placed on or broadcast over response tokens;
- ``advantages``: GRPO / Dr.GRPO, RLOO and REINFORCE++ (plain, and with a group baseline) advantage estimators;
- ``kl``: per-token KL estimators (k1, abs, k2/mse, k3/low_var_kl), KL folded into the reward, and the fixed /
  adaptive KL-coefficient controllers;
- ``aggregation``: how a [batch, response_len] loss matrix becomes one scalar (token-mean, seq-mean-...);
- ``policy_loss``: the policy losses (PPO clip with clip-higher and dual clip, GSPO, CISPO, SAPO) and the full
  actor loss (+ KL, - entropy);
- ``rollout_correction``: importance-sampling weights (token / sequence, truncated or masked) for the gap between
  the rollout engine's sampling distribution and the actor's old policy;
- ``reward_shaping``: the dynamic-sampling zero-variance group filter and the DAPO overlong penalty.

Conventions shared by every function: per-token tensors are ``[batch, response_len]`` with a 0/1
``response_mask`` (bool, integer or float); values under ``mask == 0`` never influence a result or a gradient;
per-sequence tensors are ``[batch]``; ``group_ids`` is a LongTensor ``[batch]`` naming the prompt each sample
belongs to, and the samples of a group need not be contiguous. Metrics are returned as detached 0-dim tensors
(no host synchronisation) unless a function says otherwise.
"""
