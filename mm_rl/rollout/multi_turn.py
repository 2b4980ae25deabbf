"""Multi-turn rollouts with tools: every trajectory alternates model turns and tool turns until the model answers.

The first turn is the engine's ordinary ``generate`` (the bounds policy, n samples per prompt); each sample becomes a
trajectory. After every model turn, the trajectories whose turn called tools get their answers (the job's tools,
:mod:`mm_rl.tools.runner`), the tool turn's tokens are appended (``loss_mask`` 0) and all of them continue together
in one engine call, one sample each, their prompt the trajectory so far: vLLM's prefix cache finds the earlier
turns' KV blocks, and the loop runs inside one engine replica's process, so a trajectory's turns stay on the replica
that served its first.

Tokens are never re-rendered: a model turn's ids are kept as the engine sampled them (its stop token included) and a
tool turn's ids are the chat template's text between that stop token and the next assistant header (the separator
after the stop token, the tool answers, the header), tokenised once, with each tool image's pad expanded to its
token count by the prompt images' processor. The actor scores exactly these ids, and the engine re-expands the pads
of the same images with the same processor settings, which :meth:`VllmEngine._check_prompt_ids` verifies at every
turn.

A trajectory ends with ``stop`` (a turn without tool calls), ``length`` (a turn cut at max_tokens, or the
trajectory's budget reached: a tool turn that does not fit is not appended) or ``turns`` (still calling tools in
its last allowed turn). A malformed call is answered with an error text and counted; the trajectory goes on.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from mm_rl.models.family import QWEN_VISION_TOKENS
from mm_rl.rollout.base import (
    RolloutOutputs,
    RolloutRequest,
    RolloutSample,
    SamplingSpec,
    Turns,
    count_samples,
)
from mm_rl.rollout.bounds import vision_token_ids
from mm_rl.tools import ToolCallError, parse_tool_calls
from mm_rl.tools.runner import ToolRequest, ToolResult

if TYPE_CHECKING:
    from PIL import Image

    from mm_rl.config.schema import MultiTurnConfig
    from mm_rl.data.tool_prompts import ToolPromptProcessor
    from mm_rl.rollout.base import FinishReason, RolloutEngine

TURN_END = "<|im_end|>"  # the Qwen families' end of a turn (their generation stop token)


class ToolExecutor(Protocol):
    """Runs a batch of tool calls: in this process (:class:`mm_rl.tools.runner.ToolRunner`) or on the job's
    reward / tool workers (:class:`mm_rl.rewards.worker.RayTools`)."""

    def run(self, requests: Sequence[ToolRequest]) -> list[ToolResult]: ...


class ToolTurns:
    """The token ids of a tool turn, from the chat template (see the module docstring)."""

    def __init__(self, processor: ToolPromptProcessor) -> None:
        self.processor = processor
        self.base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        self.base_text = processor.render_turns(self.base, add_generation_prompt=False)
        after = self.base_text[self.base_text.rindex("a") + 1 :]
        if not after.startswith(TURN_END):
            raise ValueError(f"the chat template does not end an assistant turn with {TURN_END}: {after!r}")
        self.separator = after[len(TURN_END) :]  # what follows the stop token the model generated
        tokenizer = processor.tokenizer
        self.specials = [token for token in tokenizer.all_special_tokens if token.startswith("<|")]

    def ids(self, results: Sequence[ToolResult]) -> list[int]:
        """The tool turn for ``results`` (one tool message each, its images first), up to the next assistant header."""
        messages = [{"role": "tool", "content": self._content(result)} for result in results]
        text = self.processor.render_turns(self.base + messages, add_generation_prompt=True)
        if not text.startswith(self.base_text):
            raise ValueError("the chat template renders earlier turns differently once tool answers follow")
        ids = self.processor.text_ids(self.separator + text[len(self.base_text) :])
        images = [image for result in results for image in result.images]
        counts = self.processor.images(images)[0] if images else []
        return self.processor.expand(ids, counts)

    def _content(self, result: ToolResult) -> str | list[dict[str, Any]]:
        text = self._plain(result.text)
        if not result.images:
            return text
        return [{"type": "image"} for _ in result.images] + [{"type": "text", "text": text}]

    def _plain(self, text: str) -> str:
        """A tool's text with special-token strings broken up: an answer must not open turns or images."""
        for token in self.specials:
            text = text.replace(token, token[:1] + " " + token[1:])
        return text


@dataclass
class Trajectory:
    """One sample's turns so far."""

    prompt_ids: list[int]
    prompt_images: list[Image.Image]
    ids: list[int] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)
    turns: Turns = field(default_factory=lambda: Turns([], turns=0))
    last: RolloutSample | None = None  # the latest model turn
    finish: FinishReason | None = None

    def add_model_turn(self, sample: RolloutSample, room: int) -> None:
        """The engine's turn, cut to the ``room`` left in the trajectory's budget."""
        ids, logprobs, finish = sample.response_ids, sample.logprobs, sample.finish_reason
        if len(ids) > room:
            ids, logprobs, finish = ids[:room], logprobs[:room], "length"
        self.last = dataclasses.replace(sample, response_ids=list(ids), logprobs=logprobs, finish_reason=finish)
        self.ids += ids
        self.logprobs.append(logprobs.float())
        self.turns.loss_mask += [1] * len(ids)
        self.turns.turns += 1

    def add_tool_turn(self, ids: list[int], results: Sequence[ToolResult]) -> None:
        self.ids += ids
        self.logprobs.append(torch.zeros(len(ids)))
        self.turns.loss_mask += [0] * len(ids)
        self.turns.images += [image for result in results for image in result.images]
        self.turns.tool_calls += len(results)
        self.turns.tool_errors += sum(result.error for result in results)
        self.turns.malformed += sum(result.malformed for result in results)
        self.turns.tool_s += sum(result.seconds for result in results)

    def request(self) -> RolloutRequest:
        return RolloutRequest(self.prompt_ids + self.ids, images=self.prompt_images + self.turns.images)

    def sample(self) -> RolloutSample:
        assert self.finish is not None and self.last is not None
        logprobs = torch.cat(self.logprobs) if self.logprobs else torch.zeros(0)
        return RolloutSample(self.ids, logprobs, self.finish, None, self.turns)


class AgentLoop:
    """Multi-turn generation over an engine (see the module docstring)."""

    def __init__(self, settings: MultiTurnConfig, processor: ToolPromptProcessor, tools: ToolExecutor) -> None:
        self.settings, self.processor, self.tools = settings, processor, tools
        self.tool_turns = ToolTurns(processor)
        self.vision_ids = vision_token_ids(processor.tokenizer, QWEN_VISION_TOKENS)

    def generate(self, engine: RolloutEngine, requests: Sequence[RolloutRequest], spec: SamplingSpec) -> RolloutOutputs:
        """n trajectories per request, index-aligned with ``requests`` like ``engine.generate``'s outputs."""
        start = time.perf_counter()
        budget = self.settings.max_tokens
        outputs = engine.generate(requests, dataclasses.replace(spec, max_tokens=min(spec.max_tokens, budget)))
        trajectories: list[list[Trajectory]] = []
        for request, output in zip(requests, outputs, strict=True):
            group = []
            for sample in output.samples:
                trajectory = Trajectory(list(output.prompt_ids), list(request.images))
                trajectory.add_model_turn(sample, budget)
                group.append(trajectory)
            trajectories.append(group)
        active = [t for group in trajectories for t in group]
        while active:
            active = self._tool_turns(active)
            if active:
                room = max(budget - len(t.ids) for t in active)
                turn_spec = dataclasses.replace(spec, max_tokens=min(spec.max_tokens, room))
                for trajectory, sample in zip(
                    active, engine.continue_turns([t.request() for t in active], turn_spec), strict=True
                ):
                    trajectory.add_model_turn(sample, budget - len(trajectory.ids))
        for output, group in zip(outputs, trajectories, strict=True):
            output.samples = [trajectory.sample() for trajectory in group]
        count_samples(outputs, start)
        return outputs

    def _tool_turns(self, active: Sequence[Trajectory]) -> list[Trajectory]:
        """Ends the trajectories whose last turn answered (or cannot go on); runs the others' tool calls and appends
        their tool turns. Returns the trajectories that continue."""
        calling: list[tuple[Trajectory, list[ToolRequest]]] = []
        for trajectory in active:
            requests = self._calls(trajectory)
            if requests is not None:
                calling.append((trajectory, requests))
        results = iter(self.tools.run([request for _, requests in calling for request in requests]))
        going = []
        for trajectory, requests in calling:
            answers = self._image_limit(trajectory, [next(results) for _ in requests])
            try:
                ids = self.tool_turns.ids(answers)
            except ValueError as error:  # an image the processor refuses (aspect ratio): the model hears why
                answers = [ToolResult(f"the tool's image cannot be shown: {error}", error=True)] * len(answers)
                ids = self.tool_turns.ids(answers)
            if len(trajectory.ids) + len(ids) >= self.settings.max_tokens:  # no room left for a model turn
                trajectory.finish = "length"
                continue
            trajectory.add_tool_turn(ids, answers)
            going.append(trajectory)
        return going

    def _calls(self, trajectory: Trajectory) -> list[ToolRequest] | None:
        """The tool calls of the trajectory's last turn, or None (and its finish set) when it ends there."""
        last = trajectory.last
        assert last is not None
        if last.finish_reason != "stop" or self.vision_ids.intersection(last.response_ids):
            trajectory.finish = last.finish_reason  # cut at max_tokens; a vision token: the trainer cuts it
            return None
        text = self.processor.tokenizer.decode(last.response_ids, skip_special_tokens=True)
        images = trajectory.prompt_images + trajectory.turns.images
        try:
            requests = [ToolRequest(call, images) for call in parse_tool_calls(text)]
        except ToolCallError as error:
            requests = [ToolRequest(None, images, error=str(error))]
        if not requests:
            trajectory.finish = "stop"
            return None
        if trajectory.turns.turns >= self.settings.max_turns:
            trajectory.finish = "turns"
            return None
        return requests

    def _image_limit(self, trajectory: Trajectory, results: list[ToolResult]) -> list[ToolResult]:
        """Images past the trajectory's ``max_tool_images`` are replaced by an error text (the engine reserved
        room for that many only)."""
        left = self.settings.max_tool_images - len(trajectory.turns.images)
        out = []
        for result in results:
            if len(result.images) > left:
                result = ToolResult(
                    f"the tool returned an image past the limit of {self.settings.max_tool_images} per problem",
                    error=True,
                    seconds=result.seconds,
                )
            left -= len(result.images)
            out.append(result)
        return out
