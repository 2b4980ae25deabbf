"""A tool-use warm-up for the embedded tiny Qwen2.5-VL: the multi-turn demo starts, like an agentic run from an
instruct model, with a model that calls the calculator in the right format but has not learnt which operation a
problem needs.

The demo's problems need one step of arithmetic on the numbers the question states (``TOOL_TEMPLATES``: a segment
AC split at B, AC and AB given, x = AC - AB; a square whose perimeter is given, x = P / 4), which the 4-layer model
does not learn in minutes by itself. The warm-up is a supervised fine-tune on whole trajectories::

    [<tool_call>{"name": "crop_image", "arguments": {"box": [0, 0, 1, 1], "zoom": 1}}</tool_call>   (crop_share)
     <tool_response>(the figure again)</tool_response>]
    <tool_call>{"name": "calculator", "arguments": {"expression": "a op b"}}</tool_call>
    <tool_response>value</tool_response>
    <think> value </think> \\boxed{value}

where a and b are the question's operands, op is the one the problem needs in ``right_share`` of the targets and
another of + - * / otherwise, and the tool answers are the real tools' (:mod:`mm_rl.tools.runner`), tokenised by the
multi-turn loop's own code (:class:`mm_rl.rollout.multi_turn.ToolTurns`): the loss covers the model turns only. GRPO
then has the format, a reward in about a quarter of the samples and one thing to learn: which operation each problem
needs. Some trajectories look at the figure first (a tool image: the demo exercises both tools).

Before and after, the model runs the real multi-turn loop (:class:`~mm_rl.rollout.multi_turn.AgentLoop` over the
transformers engine, temperature 1) on the first test prompts: the format, accuracy and score of the final answers,
and the share of trajectories that called the calculator / the crop tool. Like the format warm-up it runs in a
child process with pinned kernels and once per machine (:func:`mm_rl.demo.tiny_warmup.warm_up`).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mm_rl.demo import tiny
from mm_rl.demo.tiny_warmup import Warmup, _one_thread_seeded, _progress, _save_weights, _seeded, warm_up

if TYPE_CHECKING:
    from mm_rl.data.dataset import PromptItem
    from mm_rl.data.tool_prompts import ToolPromptProcessor
    from mm_rl.rollout.multi_turn import ToolTurns
    from mm_rl.tools.runner import ToolRunner

TOOL_TEMPLATES: tuple[str, ...] = ("segment_sum", "square_perimeter")
TOOLS: tuple[str, ...] = ("calculator", "crop_image")
CHAT_TEMPLATE = "compact_tools"  # the tools by name and argument names: short prompts for the tiny model
OPERATIONS = ("+", "-", "*", "/")
_VERSION = 1
_IGNORE = -100
Target = tuple[list[int], list[int], list[Any]]  # a trajectory's ids, loss mask and tool images


@dataclass(frozen=True)
class ToolWarmupArgs:
    """Everything that determines the warmed-up weights and the measured metrics."""

    steps: int = 500
    seed: int = 0
    lr: float = 1e-3
    batch_size: int = 16
    train_prompts: int = 128
    eval_prompts: int = 8
    samples_per_prompt: int = 4
    max_new_tokens: int = 96  # per model turn (a crop call is ~70 tokens of the tiny tokenizer)
    min_pixels: int = 56 * 56
    max_pixels: int = 224 * 224
    max_prompt_length: int = 256
    right_share: float = 0.25
    crop_share: float = 0.25
    template_sha256: str = ""  # the chat template's text (a file, not a module: it enters the cache key here)


def multi_turn_settings(max_tokens: int = 320) -> Any:
    """The demo's ``rl_config.multi_turn`` (both tools, the compact template)."""
    from mm_rl.config.schema import MultiTurnConfig

    return MultiTurnConfig(
        enable=True, tools=list(TOOLS), chat_template=CHAT_TEMPLATE, max_tokens=max_tokens, max_turns=4
    )


def operands(question: str) -> tuple[str, str, str]:
    """(a, b, the operation the problem needs) of a ``TOOL_TEMPLATES`` question."""
    numbers = re.findall(r"\d+", question)
    if "segment" in question:
        return numbers[0], numbers[1], "-"
    if "perimeter of the square" in question:
        return numbers[0], "4", "/"
    raise ValueError(f"not a tool demo problem: {question!r}")


def question_of(item: PromptItem) -> str:
    """The user turn's text (the system turn lists the tools)."""
    return item.prompt_text.rsplit("<|im_start|>user", 1)[-1]


def call_text(name: str, arguments: dict[str, Any]) -> str:
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def trajectory(
    rng: random.Random, item: PromptItem, runner: ToolRunner, turns: ToolTurns, args: ToolWarmupArgs
) -> Target:
    """A target trajectory for ``item`` (see the module docstring): its ids after the prompt, the loss mask and the
    tools' images."""
    from mm_rl.tools import ToolCall
    from mm_rl.tools.runner import ToolRequest

    processor = turns.processor
    a, b, right = operands(question_of(item))
    op = right if rng.random() < args.right_share else rng.choice([o for o in OPERATIONS if o != right])
    calls = [("calculator", {"expression": f"{a} {op} {b}"})]
    if rng.random() < args.crop_share:
        calls.insert(0, ("crop_image", {"box": [0, 0, 1, 1], "zoom": 1}))
    ids: list[int] = []
    mask: list[int] = []
    images: list[Any] = []
    value = ""
    for name, arguments in calls:
        turn = processor.text_ids(call_text(name, arguments)) + [tiny.EOS_TOKEN_ID]
        (result,) = runner.run([ToolRequest(ToolCall(name, arguments), list(item.images) + images)])
        answer = turns.ids([result])
        ids += turn + answer
        mask += [1] * len(turn) + [0] * len(answer)
        images += result.images
        value = result.text
    final = processor.text_ids(f"<think> {value} </think> \\boxed{{{value}}}") + [tiny.EOS_TOKEN_ID]
    return ids + final, mask + [1] * len(final), images


def _batch(items: Sequence[PromptItem], targets: Sequence[Target], processor: ToolPromptProcessor) -> dict[str, Any]:
    """Right-padded prompt + trajectory ids; labels on the model turns only; the prompts' and tools' images."""
    import torch

    from mm_rl.models.family import hf_token_types

    length = max(len(item.input_ids) + len(ids) for item, (ids, _, _) in zip(items, targets, strict=True))
    input_ids = torch.full((len(items), length), tiny.PAD_TOKEN_ID, dtype=torch.long)
    labels = torch.full_like(input_ids, _IGNORE)
    attention = torch.zeros_like(input_ids)
    pixels, grids = [], []
    for row, (item, (ids, mask, images)) in enumerate(zip(items, targets, strict=True)):
        prompt, n = len(item.input_ids), len(item.input_ids) + len(ids)
        input_ids[row, :n] = torch.cat([item.input_ids, torch.tensor(ids, dtype=torch.long)])
        trained = torch.tensor(mask, dtype=torch.bool)
        labels[row, prompt:n] = torch.where(trained, input_ids[row, prompt:n], _IGNORE)
        attention[row, :n] = 1
        pixels.append(item.pixel_values)
        grids.append(item.image_grid_thw)
        if images:
            _, tool_pixels, tool_grids = processor.images(images)
            pixels.append(tool_pixels)
            grids.append(tool_grids)
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "mm_token_type_ids": hf_token_types(input_ids, tiny.IMAGE_TOKEN_ID),
        "labels": labels,
        "pixel_values": torch.cat(pixels),
        "image_grid_thw": torch.cat(grids),
    }


def _train(
    model: Any, items: list[PromptItem], turns: ToolTurns, runner: ToolRunner, args: ToolWarmupArgs
) -> list[float]:
    """AdamW on target trajectories; returns the loss of every step."""
    import torch

    rng = random.Random(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(args.steps):
        chosen = rng.sample(items, min(args.batch_size, len(items)))
        targets = [trajectory(rng, item, runner, turns, args) for item in chosen]
        loss = model(**_batch(chosen, targets, turns.processor)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if (step + 1) % max(1, args.steps // 10) == 0:
            _progress(f"step {step + 1}/{args.steps}, loss {losses[-1]:.3f}", "tool warm-up")
    model.eval()
    return losses


def evaluate(
    hf_dir: Path, items: list[PromptItem], processor: ToolPromptProcessor, runner: ToolRunner, args: ToolWarmupArgs
) -> dict[str, float]:
    """The real multi-turn loop over the transformers engine on ``items``: the final answers' format, accuracy and
    score, and the share of trajectories that called the calculator and the crop tool."""
    from mm_rl.config.schema import GenerateConfig
    from mm_rl.rewards.geo3k import compute_score
    from mm_rl.rollout.base import RolloutRequest, SamplingSpec
    from mm_rl.rollout.hf_engine import HfEngine
    from mm_rl.rollout.multi_turn import AgentLoop

    settings = multi_turn_settings()
    config = GenerateConfig(backend="hf", max_model_len=640, max_num_seqs=64)
    engine = HfEngine(hf_dir, config, min_pixels=args.min_pixels, max_pixels=args.max_pixels, seed=args.seed)
    loop = AgentLoop(settings, processor, runner)
    spec = SamplingSpec(max_tokens=args.max_new_tokens, temperature=1.0, n=args.samples_per_prompt)
    outputs = loop.generate(engine, [RolloutRequest.from_item(item) for item in items], spec)
    scores = []
    for item, output in zip(items, outputs, strict=True):
        for sample in output.samples:
            assert sample.turns is not None
            answer = processor.tokenizer.decode(sample.turns.answer(sample.response_ids), skip_special_tokens=True)
            text = processor.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
            scores.append(
                compute_score(answer, item.ground_truth)
                | {"calculator": float('"calculator"' in text), "crop": float('"crop_image"' in text)}
            )
    keys = ("format", "accuracy", "score", "calculator", "crop")
    return {key: round(sum(s[key] for s in scores) / len(scores), 6) for key in keys}


def _run(hf_dir: Path, data_dir: Path, args: ToolWarmupArgs) -> dict[str, Any]:
    from mm_rl.platform import cpu_wheels

    cpu_wheels.install()
    from transformers import AutoModelForImageTextToText

    from mm_rl.data.dataset import PromptDataset
    from mm_rl.data.tool_prompts import ToolPromptProcessor
    from mm_rl.rollout.multi_turn import ToolTurns
    from mm_rl.tools.runner import ToolRunner

    start = time.perf_counter()
    settings = multi_turn_settings()
    with _one_thread_seeded(args.seed), tiny.quiet_progress():
        processor = ToolPromptProcessor.for_job(hf_dir, args.min_pixels, args.max_pixels, settings)
        runner = ToolRunner(settings.tools, settings.tool_timeout, settings.max_tool_output_chars, threads=1)
        train = _items(PromptDataset(data_dir, "train", processor, max_prompt_length=args.max_prompt_length), args)
        test = _items(PromptDataset(data_dir, "test", processor, max_prompt_length=args.max_prompt_length), args)
        model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype="float32").eval()
        _progress(f"scoring {len(test)} test prompts before", "tool warm-up")
        before = _seeded(args.seed + 1, lambda: evaluate(hf_dir, test, processor, runner, args))
        losses = _seeded(args.seed, lambda: _train(model, train, ToolTurns(processor), runner, args))
        _save_weights(model, hf_dir)
        _progress(f"scoring {len(test)} test prompts after", "tool warm-up")
        after = _seeded(args.seed + 1, lambda: evaluate(hf_dir, test, processor, runner, args))
    return {
        "before": before,
        "after": after,
        "losses": [round(losses[0], 4), round(losses[-1], 4)] if losses else [],
        "wall_time_s": round(time.perf_counter() - start, 2),
        "args": asdict(args),
    }


def _items(dataset: Any, args: ToolWarmupArgs) -> list[PromptItem]:
    """The first prompts of a split: ``train_prompts`` of the train split, ``eval_prompts`` of the test split."""
    count = args.train_prompts if dataset.split == "train" else args.eval_prompts
    return [dataset[i] for i in range(min(count, len(dataset)))]


def _sources(record: dict[str, Any]) -> list[str]:
    """The modules whose code determines the warmed weights and metrics (the cache key)."""
    return [
        __name__,
        "mm_rl.demo.tiny_warmup",
        "mm_rl.demo.synthetic",
        "mm_rl.data.dataset",
        "mm_rl.data.tool_prompts",
        "mm_rl.rollout.multi_turn",
        "mm_rl.tools",
        "mm_rl.tools.builtin",
        "mm_rl.tools.runner",
        "mm_rl.rewards.geo3k",
        *tiny.build_sources(record["build"]["family"]),
    ]


def warm_up_tools(
    hf_dir: str | Path, data_dir: str | Path, report: Callable[[str], None] | None = None, **options: Any
) -> dict[str, Any]:
    """Teach the tiny checkpoint in ``hf_dir`` (a fresh build) the demo's tool use, in place; ``data_dir`` holds the
    synthetic set of ``TOOL_TEMPLATES``. ``options`` override ``ToolWarmupArgs`` fields. Returns ``{"before",
    "after", "losses", "wall_time_s", "args"}`` (see :func:`evaluate` for before / after); once per machine."""
    import hashlib

    from mm_rl.data.tool_prompts import SHIPPED

    digest = hashlib.sha256(SHIPPED[CHAT_TEMPLATE].read_bytes()).hexdigest()
    warmup = Warmup("tiny-tool-warmup", _VERSION, __name__, _sources)
    return warm_up(warmup, Path(hf_dir), Path(data_dir), ToolWarmupArgs(template_sha256=digest, **options), report)


if __name__ == "__main__":  # the child of tiny_warmup._run_pinned: HF_DIR DATA_DIR ARGS_JSON; prints the metrics
    import json
    import sys

    _hf, _data, _args = sys.argv[1:4]
    print(json.dumps(_run(Path(_hf), Path(_data), ToolWarmupArgs(**json.loads(_args)))))
