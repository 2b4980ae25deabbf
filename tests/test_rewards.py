"""geo3k rule reward on real response strings, batch scoring that survives errors, function loading, the Ray pool."""

import math
import sys
import types

import pytest
from ray_utils import kill_and_wait

from mm_rl.config.schema import RewardConfig
from mm_rl.rewards import load_reward_function, reward_metrics, score_batch
from mm_rl.rewards.geo3k import compute_score, last_boxed, numeric_value
from mm_rl.rewards.worker import RewardResult, chunk_bounds

RIGHT = (
    "<think>\nOpposite sides of a rectangle are equal, so x equals the side labelled 8.\n</think>\n"
    "The answer is \\boxed{8}."
)


def score(response, truth, **kwargs):
    return compute_score(response, truth, **kwargs)


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        (RIGHT, "8", (1.0, 1.0, 1.0)),  # well-formed and right
        ("<think>The perimeter is 4x = 28.</think> \\boxed{6}", "7", (0.1, 0.0, 1.0)),  # well-formed, wrong
        ("x = 8, so the answer is \\boxed{8}", "8", (0.9, 1.0, 0.0)),  # right, no think block
        ("<think>half</think>\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", (1.0, 1.0, 1.0)),  # nested braces
        ("<think>half</think>\\boxed{\\frac{1}{2}}", "0.5", (1.0, 1.0, 1.0)),  # fraction vs decimal
        ("<think>half</think>\\boxed{0.5}", "\\frac{1}{2}", (1.0, 1.0, 1.0)),
        ("<think>first 3</think> \\boxed{3} no, \\boxed{8}", "8", (1.0, 1.0, 1.0)),  # the last box wins
        ("<think>first 8</think> \\boxed{8} no, \\boxed{3}", "8", (0.1, 0.0, 1.0)),
        ("<think>\n\n</think>\n\n\\boxed{ 8 }\n\n", " 8", (1.0, 1.0, 1.0)),  # whitespace
        ("<think>a</think>\\boxed{8^{\\circ}}", "8", (1.0, 1.0, 1.0)),  # units the grader strips
        (" <think>a</think>\\boxed{8}", "8", (0.9, 1.0, 0.0)),  # must match from the first character
        ("<think>a</think> the answer is \\boxed{8", "8", (0.0, 0.0, 0.0)),  # unclosed box
        ("<think>a</think> I do not know.", "8", (0.0, 0.0, 0.0)),
        ("", "8", (0.0, 0.0, 0.0)),
    ],
)
def test_geo3k_rule_reward(response, truth, expected):
    result = score(response, truth)
    assert (result["score"], result["accuracy"], result["format"]) == pytest.approx(expected)


def test_weights_shape_the_score():
    assert score(RIGHT, "8", accuracy_weight=0.5, format_weight=0.5)["score"] == pytest.approx(1.0)
    assert score("\\boxed{8}", "8", accuracy_weight=1.0, format_weight=0.0)["score"] == 1.0


def test_numeric_tolerance_accepts_rounded_labels():
    exact = "<think>8 over 15</think>\\boxed{\\frac{8}{15}}"
    assert score(exact, "0.53")["accuracy"] == 0.0  # the label is rounded, grading is exact
    assert score(exact, "0.53", numeric_tolerance=0.01)["accuracy"] == 1.0
    assert score(exact, "0.53", numeric_tolerance=0.001)["accuracy"] == 0.0
    assert score("<think>a</think>\\boxed{2\\sqrt{3}}", "3.46", numeric_tolerance=0.01)["accuracy"] == 1.0
    assert score("<think>a</think>\\boxed{x+1}", "3.46", numeric_tolerance=0.5)["accuracy"] == 0.0
    assert numeric_value("8/15") == pytest.approx(8 / 15) and numeric_value("AB") is None


def test_last_boxed():
    assert last_boxed("\\boxed{\\frac{a}{b}} and \\boxed{\\sqrt{x^{2}}}") == "\\sqrt{x^{2}}"
    assert last_boxed("no box") is None and last_boxed("\\boxed{None}") == "None"


# ------------------------------------------------------------------------------------------ batches
def flaky(response, truth):
    if "boom" in response:
        raise RuntimeError("grader exploded")
    return {"score": float(response == truth), "hit": 1.0}


def test_score_batch_counts_errors_and_keeps_going(caplog):
    scores, components, errors = score_batch(flaky, ["a", "boom", "b", "nan"], ["a", "a", "a", "a"])
    assert scores == [1.0, 0.0, 0.0, 0.0] and errors == 1
    assert components == {"hit": [1.0, 0.0, 1.0, 1.0]}
    assert "failed on 1 of 4 samples" in caplog.text and "grader exploded" in caplog.text


def test_score_batch_rejects_non_finite_scores_and_filters_kwargs():
    def plain(response, truth):  # no weight kwargs: they are not passed
        return math.nan if response == "nan" else 0.5

    scores, components, errors = score_batch(plain, ["x", "nan"], ["1", "1"], accuracy_weight=0.9)
    assert scores == [0.5, 0.0] and components == {} and errors == 1
    scores, components, _ = score_batch(compute_score, [RIGHT], ["8"], format_weight=0.0, accuracy_weight=1.0)
    assert scores == [1.0] and components == {"accuracy": [1.0], "format": [1.0]}
    assert reward_metrics(scores, components, 0) == {
        "reward/score": 1.0,
        "reward/errors": 0.0,
        "reward/accuracy": 1.0,
        "reward/format": 1.0,
    }


def test_load_reward_function():
    assert load_reward_function("mm_rl.rewards.geo3k:compute_score") is compute_score
    module = types.ModuleType("fake_rewards")
    module.not_callable = 3
    sys.modules["fake_rewards"] = module
    try:
        with pytest.raises(TypeError, match="'fake_rewards:not_callable' is a int, not callable"):
            load_reward_function("fake_rewards:not_callable")
    finally:
        del sys.modules["fake_rewards"]
    with pytest.raises(ImportError, match="'no_such_pkg.rewards:f': cannot import module 'no_such_pkg.rewards'"):
        load_reward_function("no_such_pkg.rewards:f")
    with pytest.raises(ImportError, match="has no attribute 'nope'"):
        load_reward_function("mm_rl.rewards.geo3k:nope")
    with pytest.raises(ValueError, match="must be 'module:function'"):
        load_reward_function("mm_rl.rewards.geo3k.compute_score")


def test_chunks_and_merge():
    assert chunk_bounds(5, 2) == [(0, 3), (3, 5)] and chunk_bounds(1, 4) == [(0, 1)]
    merged = RewardResult.merge([RewardResult([1.0], {"a": [1.0]}, 0), RewardResult([0.0, 0.5], {}, 2)])
    assert merged.scores == [1.0, 0.0, 0.5] and merged.components == {"a": [1.0, 0.0, 0.0]} and merged.n_errors == 2


def test_ray_reward_pool():
    import ray

    from mm_rl.rewards.worker import RewardPool

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        pool = RewardPool(RewardConfig(num_workers=2, numeric_tolerance=0.01), num_cpus=0.25)
        responses = [RIGHT, "\\boxed{8}", "<think>a</think>\\boxed{\\frac{8}{15}}", "<think>a</think>\\boxed{3}"]
        result = pool.score(responses, ["8", "8", "0.53", "8"])
        assert result.scores == pytest.approx([1.0, 0.9, 1.0, 0.1]) and result.n_errors == 0
        assert result.components["format"] == [1.0, 0.0, 1.0, 1.0]
        assert result.metrics["reward/accuracy"] == pytest.approx(0.75)
        failing = pool.score([RIGHT, None], ["8", "8"])  # None is not a string: the grader raises on it
        assert failing.scores == [1.0, 0.0] and failing.metrics["reward/errors"] == 1.0
        _a_dead_reward_worker_is_named(ray, pool)
        pool.shutdown()
    finally:
        ray.shutdown()


def _a_dead_reward_worker_is_named(ray, pool) -> None:
    """The trainer's roles raise a one-line WorkerError naming the role when a reward worker died (not Ray's
    raw error)."""
    from mm_rl.trainer.ray_roles import named
    from mm_rl.workers.group import WorkerError

    kill_and_wait(ray, pool.workers[0], "ready")  # the check below sees a dead worker every time
    with pytest.raises(WorkerError, match="^reward workers failed: ") as caught, named("reward workers"):
        pool.score([RIGHT, RIGHT], ["8", "8"])
    assert "\n" not in str(caught.value) and isinstance(caught.value.__cause__, ray.exceptions.RayError)
