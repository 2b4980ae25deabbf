"""A reward for the trainer's learning test: the geo3k reward with the ground truth replaced by one digit.

Whether a policy boxes "7" does not depend on the prompt, so the tiny model can learn it within a few dozen GRPO
steps; the real geo3k answers need reading the question, which the 4-layer demo model does not learn in minutes.
The test therefore checks that the loop optimises the reward it is given, not what the tiny model can solve.
"""

from mm_rl.rewards.geo3k import compute_score as geo3k_score

TARGET = "7"


def compute_score(response: str, ground_truth: str, **kwargs: float) -> dict[str, float]:
    return geo3k_score(response, TARGET, **kwargs)
