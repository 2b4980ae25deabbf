"""Format warm-up of the tiny checkpoint: learns the output format and an off-by-one answer habit; in place,
idempotent and deterministic."""

from mm_rl.platform import cpu_wheels

cpu_wheels.install()  # AutoProcessor builds the Qwen2-VL video processor, which imports torchvision

import json  # noqa: E402
import random  # noqa: E402

import budget  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from mm_rl import cache  # noqa: E402
from mm_rl.demo import tiny_warmup  # noqa: E402
from mm_rl.demo.synthetic import write_synthetic_geo3k  # noqa: E402
from mm_rl.demo.tiny import build_tiny_checkpoint  # noqa: E402
from mm_rl.demo.tiny_warmup import MARKER, target_response, warm_up_format  # noqa: E402
from mm_rl.rewards.geo3k import compute_score  # noqa: E402

pytestmark = pytest.mark.stack  # the warm-up trains (a minute a run): in `make test`, not `make test-quick`

STEPS = 120  # the mechanics need a short warm-up; the default one is checked on the session's tiny job


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_synthetic_geo3k(tmp_path_factory.mktemp("data") / "geo3k", seed=0)


@pytest.fixture(scope="module")
def warmed(tmp_path_factory, data_dir):
    """(checkpoint dir, its files before the warm-up, the returned metrics, torch state before and after)."""
    with budget.cache_build():
        hf_dir = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)
    before = {p.name: p.read_bytes() for p in hf_dir.iterdir()}
    threads, rng = torch.get_num_threads(), torch.random.get_rng_state()
    with budget.cache_build():
        metrics = warm_up_format(hf_dir, data_dir, seed=0, steps=STEPS)
    state = (threads, rng, torch.get_num_threads(), torch.random.get_rng_state())
    return hf_dir, before, metrics, state


def test_target_responses_box_the_answer_or_its_successor():
    rng = random.Random(0)
    responses = [target_response(rng, "9", ["14", "9"], 0.25) for _ in range(400)]
    assert all(compute_score(r, "9")["format"] == 1.0 for r in responses)
    assert all(r.startswith("<think> 14 9 </think>") for r in responses)  # the givens restated
    boxed = [r[-2] for r in responses]
    assert set(boxed) == {"9", "1"} and 0.2 < boxed.count("9") / len(boxed) < 0.3  # the successor of 9 is 1


def test_format_is_learned_but_not_the_answer(warmed):
    """A short warm-up: the format, and the answer in at most its share of the samples."""
    _, _, metrics, _ = warmed
    before, after = metrics["before"], metrics["after"]
    assert before["format"] <= 0.1
    assert after["format"] >= 0.5 and after["format"] > before["format"]
    assert after["accuracy"] < 0.5  # the answer in a quarter of the targets, its successor in the rest
    assert metrics["losses"][1] < metrics["losses"][0]
    assert metrics["wall_time_s"] > 0


def test_checkpoint_still_loads_and_only_the_weights_changed(warmed):
    from safetensors import safe_open
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    hf_dir, before, _, _ = warmed
    assert sorted(p.name for p in hf_dir.iterdir()) == sorted([*before, MARKER])  # no temporary files left
    for name, data in before.items():
        changed = (hf_dir / name).read_bytes() != data
        assert changed == (name == "model.safetensors"), name
    with safe_open(hf_dir / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in keys and "visual.merger.mlp.2.weight" in keys

    processor = AutoProcessor.from_pretrained(hf_dir)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir).eval()
    inputs = processor(text=["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"], return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits
    assert torch.isfinite(logits).all()


def test_caller_torch_state_is_restored(warmed):
    threads, rng, threads_after, rng_after = warmed[3]
    assert threads_after == threads
    assert torch.equal(rng_after, rng)


def test_second_call_is_a_no_op_and_other_arguments_are_refused(warmed, data_dir):
    hf_dir, _, metrics, _ = warmed
    weights, marker = hf_dir / "model.safetensors", hf_dir / MARKER
    stamps = weights.stat().st_mtime_ns, marker.stat().st_mtime_ns
    assert warm_up_format(hf_dir, data_dir, seed=0, steps=STEPS) == metrics
    assert (weights.stat().st_mtime_ns, marker.stat().st_mtime_ns) == stamps
    assert json.loads(marker.read_text())["metrics"] == metrics
    with pytest.raises(ValueError, match="other arguments"):
        warm_up_format(hf_dir, data_dir, seed=1, steps=STEPS)
    assert weights.stat().st_mtime_ns == stamps[0]


def test_a_second_warm_up_of_the_same_build_comes_from_the_cache(warmed, data_dir, tmp_path, monkeypatch):
    hf_dir, _, metrics, _ = warmed
    again = build_tiny_checkpoint(tmp_path / "again", seed=0)
    monkeypatch.setattr(tiny_warmup, "_run_pinned", lambda *a: pytest.fail("warmed up again"))
    assert warm_up_format(again, data_dir, seed=0, steps=STEPS) == metrics
    for name in ("model.safetensors", MARKER):
        assert (again / name).read_bytes() == (hf_dir / name).read_bytes()


def test_same_seed_gives_identical_weights(data_dir, tmp_path, monkeypatch):
    """A warm-up from scratch (an empty cache) repeats the cached one byte for byte: the cache holds what a build
    gives, not a one-off. (A short warm-up: the determinism of the whole one shows in the demo's resumed runs.)"""
    short = {"steps": 20, "eval_prompts": 2, "samples_per_prompt": 4}
    with budget.cache_build():
        cached = warm_up_format(build_tiny_checkpoint(tmp_path / "cached", seed=0), data_dir, seed=0, **short)
    monkeypatch.setenv(cache.ENV, str(tmp_path / "empty_cache"))
    progress: list[str] = []
    fresh = warm_up_format(
        build_tiny_checkpoint(tmp_path / "fresh", seed=0), data_dir, seed=0, report=progress.append, **short
    )
    assert (tmp_path / "empty_cache").is_dir()  # the fresh warm-up really ran (into its own cache)
    # its progress reached the caller as it ran: the phases and every tenth of the steps
    assert progress[0] == "tiny warm-up: scoring 2 test prompts before"
    assert [line.split(",")[0] for line in progress[1:-1]] == [f"tiny warm-up: step {n}/20" for n in range(2, 21, 2)]
    assert progress[-1] == "tiny warm-up: scoring 2 test prompts after"
    weights = [(tmp_path / which / "model.safetensors").read_bytes() for which in ("fresh", "cached")]
    assert weights[0] == weights[1]
    measured = ("before", "after", "losses")
    assert {k: fresh[k] for k in measured} == {k: cached[k] for k in measured}


def test_refuses_a_directory_that_is_not_a_tiny_checkpoint(tmp_path, data_dir):
    with pytest.raises(ValueError, match="not a tiny checkpoint"):
        warm_up_format(tmp_path, data_dir)
    assert tiny_warmup.WarmupArgs().max_new_tokens == 64


def test_the_default_warm_up_reads_the_givens_and_half_knows_the_answer(tiny_base):
    """The session's tiny job (default warm-up, demo data): format learned, the question's numbers restated in
    the reasoning, the boxed digit the answer about as often as in the targets (a quarter), so GRPO has the rest
    to learn."""
    after = json.loads((tiny_base / "tiny_hf" / MARKER).read_text())["metrics"]["after"]
    assert after["format"] >= 0.9 and after["restates"] >= 0.6 and 0.1 <= after["accuracy"] <= 0.4
