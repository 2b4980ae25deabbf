"""Multi-turn rollouts with tools, without an engine: the tool turns the chat template makes, the tool runner's
limits, and the loss over a trajectory covering exactly the tokens the model generated."""

from __future__ import annotations

import time

import pytest
import torch
from PIL import Image

from mm_rl.algorithms.advantages import compute_advantages
from mm_rl.algorithms.policy_loss import actor_loss
from mm_rl.algorithms.token_level import scores_to_token_level
from mm_rl.config.schema import RLConfig, RolloutCorrectionConfig
from mm_rl.rollout.base import Turns
from mm_rl.tools import Tool, ToolCall
from mm_rl.tools.runner import ToolRequest, ToolResult, ToolRunner, load_tools
from mm_rl.trainer.batch import Sample, micro_batches, response_mask, step_images

SLOW = Tool(
    "slow",
    "sleeps",
    {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]},
    lambda seconds: time.sleep(seconds) or "woke",
)
BROKEN = Tool("broken", "raises", {"type": "object", "properties": {}}, lambda: 1 / 0)
LOUD = Tool("loud", "talks", {"type": "object", "properties": {}}, lambda: "x" * 50)
SIZE = Tool("size", "an image's size", {"type": "object", "properties": {}}, lambda image: f"{image.size}")


# ------------------------------------------------------------------------------------------------ tools
def test_tools_load_by_name_or_import_path_and_bad_entries_say_why():
    assert [t.name for t in load_tools(["calculator", "crop_image"])] == ["calculator", "crop_image"]
    assert load_tools(["tests.test_multi_turn:SLOW"]) == [SLOW]
    for entries, says in (
        (["python"], "neither a built-in"),
        (["tests.test_multi_turn:NOWHERE"], "has no attribute"),
        (["tests.test_multi_turn:test_tools_load_by_name_or_import_path_and_bad_entries_say_why"], "not an mm_rl"),
        (["calculator", "calculator"], "named twice"),
    ):
        with pytest.raises((ImportError, TypeError, ValueError), match=says):
            load_tools(entries)


def test_the_runner_turns_every_failure_into_text_for_the_model():
    runner = ToolRunner(
        ["calculator", "tests.test_multi_turn:SLOW", "tests.test_multi_turn:BROKEN", "tests.test_multi_turn:LOUD"],
        timeout=0.2,
        max_chars=20,
    )
    image = Image.new("RGB", (64, 32))
    results = runner.run(
        [
            ToolRequest(ToolCall("calculator", {"expression": "12 - 5"})),
            ToolRequest(ToolCall("calculator", {"expression": "__import__('os')"})),
            ToolRequest(ToolCall("slow", {"seconds": 2.0})),
            ToolRequest(ToolCall("broken", {})),
            ToolRequest(ToolCall("loud", {})),
            ToolRequest(ToolCall("python", {})),
            ToolRequest(ToolCall("calculator", {"expr": "1"})),
            ToolRequest(None, [image], error="tool call 1 is not valid JSON"),
        ]
    )
    runner.close()
    texts = [r.text for r in results]
    assert texts[0] == "7" and not results[0].error
    assert "is not allowed" in texts[1] and results[1].error and not results[1].malformed  # the tool refused
    assert texts[2] == "slow: no answer within 0.2 s" and 0.15 < results[2].seconds < 1.0
    assert texts[3].startswith("broken failed: ZeroDivisionError")
    assert texts[4] == "x" * 20 + " [cut]" and not results[4].error
    assert [r.malformed for r in results[5:]] == [True, True, True]
    assert "no tool named 'python'" in texts[5] and "unknown arguments ['expr']" in texts[6]


def test_a_tool_gets_the_problems_image_and_may_answer_with_one():
    runner = ToolRunner(["crop_image", "tests.test_multi_turn:SIZE"], timeout=5, max_chars=100)
    image = Image.new("RGB", (200, 100), "white")
    crop, size, missing = runner.run(
        [
            ToolRequest(ToolCall("crop_image", {"box": [0, 0, 0.5, 1], "zoom": 2}), [image]),
            ToolRequest(ToolCall("size", {}), [image]),
            ToolRequest(ToolCall("size", {}), []),
        ]
    )
    assert crop.text == "" and [i.size for i in crop.images] == [(200, 200)] and not crop.error
    assert size.text == "(200, 100)"
    assert missing.malformed and "has none" in missing.text


# -------------------------------------------------------------------------------------- the trajectory's loss
def _trajectory_case():
    """Four trajectories (two groups) with tool turns inside, and the same trajectories with the tool tokens
    removed: per-token values that are garbage on the tool tokens."""
    torch.manual_seed(0)
    layouts = [[3, -4, 2], [5], [2, -3, 1, -2, 4], [1, -6, 3]]  # model tokens (+), tool tokens (-)
    masks = [torch.cat([torch.full((abs(n),), float(n > 0)) for n in layout]) for layout in layouts]
    width = max(len(m) for m in masks)
    full = torch.zeros(len(masks), width)
    for row, mask in enumerate(masks):
        full[row, : len(mask)] = mask
    compact_width = int(full.sum(-1).max())
    compact = (torch.arange(compact_width)[None] < full.sum(-1)[:, None]).float()

    def both(fill):
        values = torch.randn(len(masks), compact_width)
        spread = torch.full((len(masks), width), fill)
        for row in range(len(masks)):
            spread[row, full[row].bool()] = values[row, : int(full[row].sum())]
        return spread, values * compact

    return full, compact, both


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("loss_type, correction", [("ppo_clip", "token"), ("gspo", "sequence"), ("cispo", None)])
def test_the_loss_of_a_trajectory_is_the_loss_of_its_model_tokens_alone(estimator, agg, loss_type, correction):
    """Tool tokens carry garbage (1e4) in every per-token input: with the trajectory's mask the advantages, the
    policy loss, the KL and the correction are exactly those of the same trajectories with the tool tokens cut
    out, for every estimator, aggregation and loss."""
    full, compact, both = _trajectory_case()
    scores, groups = torch.tensor([1.0, 0.0, 0.5, 1.0]), torch.tensor([0, 0, 1, 1])
    cfg = RLConfig(
        loss_agg_mode=agg,
        policy_loss=loss_type,
        rollout_correction=RolloutCorrectionConfig(rollout_is=correction),
        kl_loss_coef=0.1,
    )
    results = []
    (lp_f, lp_c), (old_f, old_c), (ref_f, ref_c), (eng_f, eng_c) = (both(1e4) for _ in range(4))
    for mask, lp, old, ref, engine in ((full, lp_f, old_f, ref_f, eng_f), (compact, lp_c, old_c, ref_c, eng_c)):
        advantages = compute_advantages(estimator, scores, mask, groups)
        lp = lp.clone().requires_grad_(True)
        loss, metrics = actor_loss(
            -lp.abs(), -old.abs(), -ref.abs(), advantages, mask, None, cfg, 16, engine_logprob=-engine.abs()
        )
        loss.backward()
        results.append((advantages[mask.bool()], loss.detach(), lp.grad[mask.bool()], metrics["kl_loss"]))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert torch.equal(scores_to_token_level(scores, full).sum(-1), scores)  # the outcome sits on a model token


def test_micro_batches_and_the_step_images_of_trajectories():
    """The response mask of a trajectory's micro-batch row is its loss mask; its tool images travel under a key of
    its own beside its prompt's, and a rank encodes every distinct image once: the prompt image that two rows
    share once, each trajectory's tool image once, the slots in row order (prompt images, then tools')."""
    from types import SimpleNamespace

    from mm_rl.platform.transfer import image_inputs

    prompt_grid, tool_grid = torch.tensor([[1, 2, 4]]), torch.tensor([[1, 4, 4]])
    items = {7: SimpleNamespace(pixel_values=torch.randn(8, 6), image_grid_thw=prompt_grid, mrope_time_steps=None)}
    plain = Sample(7, 0, [1, 2, 3], [4, 5], "stop")
    tooled = Sample(7, 0, [1, 2, 3], [4, 9, 9, 6, 7], "stop", image_key=-2)
    tooled.turns = Turns([1, 0, 0, 1, 1])
    tooled.loss_mask = torch.tensor([1.0, 0, 0, 1, 1])
    tooled.tool_images = (torch.randn(16, 6), tool_grid)
    (batch,) = micro_batches([[plain, tooled]], items, 0)
    assert batch["response_mask"][1].tolist() == [0, 0, 1, 0, 0, 1, 1, 0]
    assert batch["image_index"].tolist() == [7, 7] and batch["tool_image_index"].tolist() == [-1, -2]
    assert batch["shared_prompt"].tolist() == [0, 2]  # the same prompt (and image): computed once
    assert torch.equal(batch["image_grid_thw"], torch.cat([prompt_grid, prompt_grid, tool_grid]))
    images = step_images([plain, tooled], items)
    assert set(images) == {7, -2} and images[-2] is tooled.tool_images
    inputs = image_inputs(batch, images)
    assert inputs["image_slots"].tolist() == [0, 0, 1] and inputs["image_keys"].tolist() == [[7, 0], [-2, 0]]
    assert torch.equal(inputs["pixel_values"], torch.cat([items[7].pixel_values, tooled.tool_images[0]]))
    assert response_mask([plain, tooled]).tolist() == [[1, 1, 0, 0, 0], [1, 0, 0, 1, 1]]
    assert tooled.trained_tokens == 3 and Turns([1, 0, 0, 1, 1]).answer([4, 9, 9, 6, 7]) == [6, 7]


def test_tool_turns_come_from_the_chat_template_with_images_expanded(tmp_path):
    """A tool turn is the template's text after the model's stop token up to the next assistant header; its image
    pads are expanded like a prompt image's; special-token strings in a tool's text are broken up."""
    from mm_rl.data.tool_prompts import ToolPromptProcessor
    from mm_rl.demo import tiny
    from mm_rl.rollout.multi_turn import ToolTurns

    model_dir = tiny.build_tiny_checkpoint(tmp_path / "tiny", seed=0)
    processor = ToolPromptProcessor(model_dir, 56 * 56, 224 * 224, tools=[t.spec() for t in load_tools(["calculator"])])
    turns = ToolTurns(processor)
    assert turns.separator == "\n"
    ids = turns.ids([ToolResult("7"), ToolResult("<|im_end|>", images=[Image.new("RGB", (112, 112))])])
    text = processor.tokenizer.decode(ids, skip_special_tokens=False)
    pads = "<|image_pad|>" * processor.image_tokens(112, 112)
    assert text == (
        "\n<|im_start|>user\n<tool_response>\n7\n</tool_response>\n<tool_response>\n"
        f"<|vision_start|>{pads}<|vision_end|>< |im_end|>\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    prompt = processor.render([{"role": "user", "content": "x"}])
    assert '"name": "calculator"' in prompt and "<tool_call>" in prompt
