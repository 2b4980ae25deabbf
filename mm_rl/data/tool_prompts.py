"""Prompts of a multi-turn job: the chat template renders the job's tools into every prompt, and the text between a
model turn and the next (the tools' answers) comes from the same template.

Which template: the one a job names (``rl_config.multi_turn.chat_template``), else the checkpoint's own when it
renders tool calls (Qwen3-VL's and Qwen3.5's do), else mm_rl's Qwen tool template (``mm_rl/tools/templates``:
``qwen_tools``, and ``compact_tools``, which lists each tool by name and argument names only, for small models with
short contexts): Qwen2-VL's and Qwen2.5-VL's published processors have no tools branch. Every template gives the
same prompt as the checkpoint's when there are no tools, so a job without tools reads its data exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mm_rl.data.dataset import PromptProcessor

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from mm_rl.config.schema import MultiTurnConfig

TEMPLATES = Path(__file__).resolve().parents[1] / "tools" / "templates"
SHIPPED = {path.stem: path for path in TEMPLATES.glob("*.jinja")}  # qwen_tools; compact_tools (names only)
TOOL_CALL_MARK = "tool_call"  # what a template that renders tool calls contains


def template_file(setting: str) -> Path:
    """The file a ``chat_template`` setting names: a template mm_rl ships (by name) or a path."""
    return SHIPPED.get(setting, Path(setting))


def tool_template(setting: str, checkpoint_template: str | None) -> str:
    """The chat template text a multi-turn job renders with (see the module docstring)."""
    if setting:
        return template_file(setting).read_text(encoding="utf-8")
    if checkpoint_template and TOOL_CALL_MARK in checkpoint_template:
        return checkpoint_template
    return SHIPPED["qwen_tools"].read_text(encoding="utf-8")


class ToolPromptProcessor(PromptProcessor):
    """A :class:`PromptProcessor` whose prompts describe ``tools`` (OpenAI-style function descriptions) and which
    renders the tool turns of a trajectory."""

    def __init__(
        self,
        model_name_or_path: str | Path,
        min_pixels: int,
        max_pixels: int,
        *,
        chat_template: str = "",
        tools: Sequence[dict[str, Any]] = (),
    ) -> None:
        super().__init__(model_name_or_path, min_pixels, max_pixels)
        self.tokenizer.chat_template = tool_template(chat_template, self.tokenizer.chat_template)
        self.tools = [dict(tool) for tool in tools]

    @classmethod
    def for_job(cls, model_name_or_path: str | Path, min_pixels: int, max_pixels: int, settings: MultiTurnConfig):
        """The processor of a multi-turn job's prompts (its tools loaded by name or import path)."""
        from mm_rl.tools.runner import load_tools

        tools = [tool.spec() for tool in load_tools(settings.tools)]
        return cls(model_name_or_path, min_pixels, max_pixels, chat_template=settings.chat_template, tools=tools)

    def render(self, messages: list[dict[str, Any]]) -> str:
        return self.render_turns(messages, add_generation_prompt=True)

    def render_turns(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """The template over ``messages`` with the tools."""
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools or None, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def images(self, images: Sequence[Image.Image]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """(image token counts, pixel values, grids) of images outside a prompt (a tool's), processed like prompt
        images: the same image processor, pixel bounds and patch merge."""
        ids, pixel_values, grid = self.encode(self.image_pad * len(images), list(images))
        return (grid.prod(dim=-1) // self.merge_size**2).tolist(), pixel_values, grid
