"""transformers rollout engine: ``generate`` on the actor's own inputs, with the same contract as the vLLM engine.

Why it exists: it needs no vLLM (any device transformers runs on), it is the reference the vLLM engine is tested
against, and on a 2-core CPU with the tiny model it is the faster of the two.

How it keeps the contract:

* Inputs are the actor's: ``prompt_ids`` as they are and the request's ``pixel_values`` / ``image_grid_thw``
  (processed here with the same ``min_pixels`` / ``max_pixels`` when a request only has images), so prompt ids
  are identical by construction. Prompts are left-padded into batches of at most ``max_num_seqs`` sequences.
* Sampling: the checkpoint's ``generation_config`` sampling defaults (Qwen ships top_k / top_p / repetition
  penalty there) are dropped; only its bos / eos / pad ids are kept, so the settings are exactly the request's.
  transformers applies temperature, then top-k, then top-p, as vLLM does; a log-prob is ``log_softmax`` of those
  processed scores at the sampled token (greedy: of the raw logits).
* Stopping: a response ends at the first of the checkpoint's eos ids (included, finish reason "stop") or after
  ``max_tokens`` ("length"); the padding after it is cut off.
* Seeds: with a seed, call k samples under ``seed + k`` in a forked RNG, so runs repeat without touching the
  process's global RNG.
* Weights: ``update_weights`` copies HF-named tensors (published checkpoint names or the module's own names) into
  the parameters one at a time, so memory stays bounded by the caller's iterator.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mm_rl.config.schema import GenerateConfig
from mm_rl.models.family import hf_token_types
from mm_rl.platform.device import current_device
from mm_rl.rollout.base import RolloutEngine, RolloutRequest, RolloutSample, SamplingSpec, engine_dtype
from mm_rl.rollout.bounds import image_runs, policy_from_config

if TYPE_CHECKING:
    import torch

# Published Qwen2.5-VL checkpoint prefixes -> the module paths of transformers 5's model.
_CHECKPOINT_PREFIXES = (
    ("model.language_model.", "model.language_model."),
    ("model.visual.", "model.visual."),
    ("model.", "model.language_model."),
    ("visual.", "model.visual."),
    ("language_model.", "model.language_model."),
)


# one routed expert's part, as the weight sync (and vLLM) names it
_EXPERT_PART = re.compile(r"^(?P<layer>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight$")


def expert_slice(name: str, tensors: dict[str, Any]) -> Any:
    """The slice of transformers' fused in-memory experts that one expert's part ``name`` is, or None.

    transformers 5.19 holds a MoE layer's experts fused whatever the checkpoint stores: ``gate_up_proj`` [E, 2F, H]
    (gate rows, then up) and ``down_proj`` [E, H, F] (Qwen3-VL-MoE and Qwen3.5-MoE alike), while the sync sends one
    tensor per expert and part."""
    match = _EXPERT_PART.match(name)
    if match is None:
        return None
    fused = "down_proj" if match["part"] == "down_proj" else "gate_up_proj"
    target = module_name(f"{match['layer']}.{fused}", tensors)
    if target is None:
        return None
    expert = tensors[target][int(match["e"])]
    if fused == "down_proj":
        return expert
    half = expert.shape[0] // 2
    return expert[:half] if match["part"] == "gate_proj" else expert[half:]


def module_name(name: str, known: Iterable[str] | dict[str, Any]) -> str | None:
    """The model's own name for a checkpoint tensor name, or None when it has no such tensor."""
    if name in known:
        return name
    for old, new in _CHECKPOINT_PREFIXES:
        if name.startswith(old) and (candidate := new + name[len(old) :]) in known:
            return candidate
    return None


class HfEngine(RolloutEngine):
    """Rollouts with ``transformers`` ``generate``; see the module docstring."""

    def __init__(
        self,
        model_path: str | Path,
        config: GenerateConfig,
        *,
        min_pixels: int,
        max_pixels: int,
        seed: int | None = None,
        dtype: str | None = None,
    ) -> None:
        import torch
        from transformers import AutoModelForImageTextToText, GenerationConfig

        from mm_rl.data.dataset import PromptProcessor

        super().__init__(policy_from_config(config, model_path, min_pixels, max_pixels))
        self.device = current_device()
        dtype = engine_dtype(config, dtype)  # transformers runs every family in fp32 on CPU
        self.processor = PromptProcessor(model_path, min_pixels, max_pixels)
        model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model = model.to(self.device).eval()
        loaded = self.model.generation_config
        eos = loaded.eos_token_id if loaded.eos_token_id is not None else self.processor.tokenizer.eos_token_id
        self.eos_ids: list[int] = [eos] if isinstance(eos, int) else list(eos)
        pad = loaded.pad_token_id if loaded.pad_token_id is not None else self.processor.tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else self.eos_ids[0]
        self.model.generation_config = GenerationConfig(
            bos_token_id=loaded.bos_token_id, eos_token_id=self.eos_ids, pad_token_id=self.pad_id
        )
        self.max_num_seqs = config.max_num_seqs
        self.seed = seed if seed is not None else config.sampling_config.seed
        self.calls = 0
        self.tensors = self.model.state_dict(keep_vars=True)  # tied weights appear under both names

    # ---------------------------------------------------------------------------------------- inputs
    def _vision(self, request: RolloutRequest) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The request's pixels and grid: the actor's when given, else processed here with the same bounds."""
        if request.videos:
            raise ValueError(
                f"request {request.uid!r} has videos: the transformers engine takes images only; set "
                "generate_config.backend: vllm for video data"
            )
        if request.pixel_values is not None and request.image_grid_thw is not None:
            return request.pixel_values, request.image_grid_thw
        if not request.images:
            return None, None
        vision = self.processor.image_processor(images=list(request.images), return_tensors="pt")
        grid = vision["image_grid_thw"].long()
        runs = [end - start for start, end in image_runs(request.prompt_ids, self.bounds.image_token_id)]
        if runs != (grid.prod(dim=-1) // self.processor.merge_size**2).tolist():
            raise RuntimeError(
                f"request {request.uid!r}: its image pad runs {runs} do not match the images processed with "
                f"min_pixels / max_pixels {self.bounds.min_pixels} / {self.bounds.max_pixels}"
            )
        return vision["pixel_values"], grid

    def _batch(self, requests: Sequence[RolloutRequest]) -> dict[str, Any]:
        """Left-padded ids and mask, and the images of the batch concatenated in order."""
        import torch

        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        pixels, grids = [], []
        for row, request in enumerate(requests):
            ids[row, width - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids, dtype=torch.long)
            mask[row, width - len(request.prompt_ids) :] = 1
            values, grid = self._vision(request)
            if values is not None:
                pixels.append(values)
                grids.append(grid)
        batch: dict[str, Any] = {
            "input_ids": ids.to(self.device),
            "attention_mask": mask.to(self.device),
            "mm_token_type_ids": hf_token_types(ids, self.bounds.image_token_id).to(self.device),
        }
        if pixels:
            batch["pixel_values"] = torch.cat(pixels).to(self.device, self.model.dtype)
            batch["image_grid_thw"] = torch.cat(grids).to(self.device)
        return batch

    # ------------------------------------------------------------------------------------- generation
    @contextlib.contextmanager
    def _rng(self) -> Iterator[None]:
        """Sample under ``seed + call`` without disturbing the global RNG (no seed: the global RNG)."""
        import torch

        if self.seed is None:
            yield
            return
        devices = [] if self.device.type == "cpu" else [self.device.index or 0]
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.manual_seed(self.seed + self.calls)
            yield

    def _reseed(self, seed: int) -> None:
        self.seed, self.calls = seed, 0

    def _generate(self, requests: Sequence[RolloutRequest], spec: SamplingSpec) -> list[list[RolloutSample]]:
        per_chunk = max(1, self.max_num_seqs // spec.n)
        results: list[list[RolloutSample]] = []
        with self._rng():
            for start in range(0, len(requests), per_chunk):
                results.extend(self._generate_chunk(requests[start : start + per_chunk], spec))
        self.calls += 1
        return results

    def _generate_chunk(self, requests: Sequence[RolloutRequest], spec: SamplingSpec) -> list[list[RolloutSample]]:
        import torch

        batch = self._batch(requests)
        sampling = (
            {} if spec.greedy else {"temperature": spec.temperature, "top_k": max(spec.top_k, 0), "top_p": spec.top_p}
        )
        with torch.inference_mode():
            out = self.model.generate(
                **batch,
                do_sample=not spec.greedy,
                **sampling,
                max_new_tokens=spec.max_tokens,
                num_return_sequences=spec.n,
                output_scores=True,
                return_dict_in_generate=True,
            )
        new = out.sequences[:, batch["input_ids"].shape[1] :].cpu()
        picked, top = self._logprobs(out.scores, new, spec.logprobs)
        samples = [self._sample(new[row], picked[row], None if top is None else top[row]) for row in range(len(new))]
        return [samples[i * spec.n : (i + 1) * spec.n] for i in range(len(requests))]

    @staticmethod
    def _logprobs(
        scores: Sequence[torch.Tensor], tokens: torch.Tensor, alternatives: int
    ) -> tuple[torch.Tensor, list[list[dict[int, float]]] | None]:
        """Log-probs of the chosen tokens under each step's processed scores, and the top alternatives if asked."""
        import torch

        picked = torch.empty(tokens.shape, dtype=torch.float32)
        top: list[list[dict[int, float]]] | None = [[] for _ in range(len(tokens))] if alternatives else None
        for step, score in enumerate(scores):
            logp = torch.log_softmax(score.float(), dim=-1).cpu()
            picked[:, step] = logp.gather(1, tokens[:, step : step + 1]).squeeze(1)
            if top is not None:
                values, ids = logp.topk(alternatives, dim=-1)
                for row in range(len(tokens)):
                    chosen = int(tokens[row, step])
                    top[row].append(
                        dict(zip(ids[row].tolist(), values[row].tolist(), strict=True))
                        | {chosen: float(picked[row, step])}
                    )
        return picked, top

    def _sample(
        self, tokens: torch.Tensor, logprobs: torch.Tensor, top: list[dict[int, float]] | None
    ) -> RolloutSample:
        """Cut after the first eos (kept, "stop"); a response without one ran to max_tokens ("length")."""
        ids = tokens.tolist()
        end = next((i + 1 for i, token in enumerate(ids) if token in self.eos_ids), None)
        length = end if end is not None else len(ids)
        return RolloutSample(
            ids[:length],
            logprobs[:length].clone(),
            "stop" if end is not None else "length",
            None if top is None else top[:length],
        )

    # ------------------------------------------------------------------------------------------- weights
    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        import torch

        count = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = module_name(name, self.tensors)
                parameter = self.tensors[target] if target is not None else expert_slice(name, self.tensors)
                if parameter is None:
                    raise KeyError(f"update_weights: the model has no tensor for {name!r}")
                if tuple(parameter.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                        f"the model's is {tuple(parameter.shape)}"
                    )
                parameter.copy_(tensor.to(parameter.device, parameter.dtype))
                count += 1
        return count
