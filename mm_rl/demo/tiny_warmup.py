"""A deterministic format warm-up for the embedded tiny Qwen2.5-VL, so GRPO starts with a reward signal.

Why a random tiny model gets zero reward: the geo3k reward pays ``format`` only when the whole response matches
``<think>.*</think>.*\\boxed{.*}.*`` and ``accuracy`` only when the last ``\\boxed{}`` holds the answer. A randomly
initialised model samples from a near-uniform 1024-way distribution, so a response starts with ``<think>`` with
probability ~1/1024 and then still needs ``</think>``, ``\\boxed{``, a digit and ``}`` in order: sampling 8 x 8
responses of 64 tokens gives reward, format and accuracy all 0.0. GRPO's advantages are rewards minus the group
mean, so identical (zero) rewards give zero advantages and nothing to learn from. Real GRPO runs start from an
instruct model that already follows the output format; this warm-up makes the embedded default mirror that.

What it does: a supervised fine-tune on prompts of the synthetic TRAIN split with targets

    <think> n1 [n2 ...] </think> \\boxed{d}<|im_end|>

where ``n1 ...`` restate the numbers the question gives (how an instruct model's reasoning starts: reading the
givens) and ``d`` is the answer in a quarter of the targets (``answer_share``) and the answer's successor (9 -> 1)
in the rest: an off-by-one habit. The model leaves the warm-up like an instruct model before RL on a task it
half knows: the format right, sampled answers right about a quarter of the time, its greedy answer wrong. GRPO
then has a signal in almost every group (8 samples, at least one right with probability 1 - 0.75^8 = 0.9) and a
skill to sharpen rather than to discover. An earlier version boxed a digit drawn independently of the answer
(accuracy at chance, 1/9): RL then had to discover the copy, which happened abruptly and, depending on the CPU's
rounding, after 30 steps, after 90 or not within 120. The loss covers the response tokens only (labels -100 on
the prompt, image tokens included).

Defaults (``WarmupArgs``): 500 AdamW steps (lr 1e-3, no weight decay, grad-norm clip 1.0) on batches of 16 drawn
from the first 128 train prompts, with a fresh target per example and step. Why these: reading a digit ~50
tokens back is a skill a 4-layer model picks up late and abruptly. Measured on the demo data (seed-0 checkpoint,
one CPU thread, ~2.4 min): with 128 prompts the reasoning restates the question's number in 92% of sampled test
responses after 500 steps; with 512 prompts or at lr 3e-3 (600 steps of 8) it had not picked the skill up yet
(restates 0.08-0.11). With the current targets: format 1.00 and accuracy 0.25 after the warm-up.
The metrics are measured before and after on the first 8 test prompts x 8 samples, at temperature 1.0 without
top-k / top-p (vLLM's defaults), up to 64 new tokens, decoded without special tokens and scored with
``mm_rl.rewards.geo3k.compute_score``; both measurements use the same sampling seed. transformers is given the
image token types (``mm_token_type_ids``), so its 3D positions are the ones vLLM and the actor use.

Determinism: one torch thread, fixed seeds for the target draws, the batch order and the sampling, a fixed set
of prompts, and the CPU kernels pinned to AVX2 in a child process (``KERNEL_ENV``): the same arguments give
byte-identical ``model.safetensors`` on the same torch build, on AVX2 and AVX-512 machines alike. The caller's
process (its RNG state, thread count, kernels) is untouched.

Files: the new weights are written as ``model.safetensors`` into a temporary file in the checkpoint directory
(same key names, dtypes and metadata as the tiny builder's) and renamed over the old one; the other files are
kept. A marker ``tiny_warmup.json`` (arguments, the base build marker, metrics) is written last, the same way;
calling again with the same arguments returns the stored metrics without touching anything. A checkpoint warmed
up with other arguments is refused: build a fresh one first. On the synthetic set the warm-up runs once per machine:
its weights and marker go into the per-machine cache (``mm_rl.cache``, keyed by the arguments, the build, the data
set's arguments and the sources of the code that computes them) and later calls copy them from there.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mm_rl import cache
from mm_rl.demo import tiny
from mm_rl.files import atomic_path, write_atomic
from mm_rl.models.family import hf_token_types
from mm_rl.models.registry import family_for_hf

if TYPE_CHECKING:
    import torch

    from mm_rl.data.dataset import PromptItem, PromptProcessor

MARKER = "tiny_warmup.json"
_VERSION = 5  # 2: image token types for transformers' 3D positions; 3: the reasoning restates the givens;
# 4: trained in a child process with AVX2 kernels (the same weights on AVX2 and AVX-512 machines);
# 5: the boxed digit is the answer or its successor (answer_share), not drawn independently of it
# What pins the CPU kernels to AVX2 in the warm-up's process: ATen's own vectorised kernels, MKL's BLAS and
# oneDNN each pick their instruction set at start-up, and each reads its own variable (read before torch loads).
# Measured on an AVX-512 machine: the default kernels gave restates 0.38 after 500 steps (0.80 after 800), too
# little for GRPO to learn from in the demo's steps; with these, restates 0.97 as on AVX2 machines.
KERNEL_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
_WEIGHTS = "model.safetensors"
_IGNORE = -100


@dataclass(frozen=True)
class WarmupArgs:
    """Everything that determines the warmed-up weights and the measured metrics."""

    steps: int = 500
    seed: int = 0
    lr: float = 1e-3
    batch_size: int = 16
    train_prompts: int = 128
    eval_prompts: int = 8
    samples_per_prompt: int = 8
    max_new_tokens: int = 64
    min_pixels: int = 56 * 56
    max_pixels: int = 224 * 224
    max_prompt_length: int = 256
    answer_share: float = 0.25


# ------------------------------------------------------------------------------------------------ helpers
@contextlib.contextmanager
def _one_thread_seeded(seed: int) -> Iterator[None]:
    """One torch thread and a seeded global RNG inside; the caller's thread count and RNG state restored after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
    finally:
        torch.set_num_threads(threads)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _load_items(
    data_dir: Path, split: str, count: int, processor: PromptProcessor, args: WarmupArgs
) -> list[PromptItem]:
    from mm_rl.data.dataset import PromptDataset

    dataset = PromptDataset(data_dir, split, processor, max_prompt_length=args.max_prompt_length)
    return [dataset[i] for i in range(min(count, len(dataset)))]


def given_numbers(prompt_text: str) -> list[str]:
    """The numbers the question states, in order (the instruction and the chat template hold none)."""
    return re.findall(r"\d+", re.sub(r"<\|[^|]*\|>", " ", prompt_text))


def target_response(rng: random.Random, answer: str, numbers: Sequence[str], answer_share: float) -> str:
    """``<think> n1 .. </think> \\boxed{d}``: the question's numbers restated; d is the answer in a share
    ``answer_share`` of the targets and the answer's successor (9 -> 1) otherwise: an off-by-one habit."""
    digit = int(answer) if rng.random() < answer_share else int(answer) % 9 + 1
    return f"<think> {' '.join(numbers)} </think> \\boxed{{{digit}}}"


# ----------------------------------------------------------------------------------------------- training
def _batch(items: list[PromptItem], responses: list[list[int]]) -> dict[str, torch.Tensor]:
    """Right-padded prompt + response ids; labels only on the response tokens."""
    import torch

    length = max(len(item.input_ids) + len(r) for item, r in zip(items, responses, strict=True))
    ids = torch.full((len(items), length), tiny.PAD_TOKEN_ID, dtype=torch.long)
    labels = torch.full_like(ids, _IGNORE)
    mask = torch.zeros_like(ids)
    for row, (item, response) in enumerate(zip(items, responses, strict=True)):
        prompt, n = item.input_ids, len(item.input_ids) + len(response)
        ids[row, :n] = torch.cat([prompt, torch.tensor(response, dtype=torch.long)])
        labels[row, len(prompt) : n] = ids[row, len(prompt) : n]
        mask[row, :n] = 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "mm_token_type_ids": hf_token_types(ids, tiny.IMAGE_TOKEN_ID),
        "labels": labels,
        "pixel_values": torch.cat([item.pixel_values for item in items]),
        "image_grid_thw": torch.cat([item.image_grid_thw for item in items]),
    }


def _train(model: Any, items: list[PromptItem], processor: PromptProcessor, args: WarmupArgs) -> list[float]:
    """AdamW on format targets; returns the loss of every step."""
    import torch

    rng = random.Random(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(args.steps):
        batch_items = rng.sample(items, min(args.batch_size, len(items)))
        responses = [
            processor.text_ids(
                target_response(rng, item.ground_truth, given_numbers(item.prompt_text), args.answer_share)
            )
            + [tiny.EOS_TOKEN_ID]
            for item in batch_items
        ]
        loss = model(**_batch(batch_items, responses)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if (step + 1) % max(1, args.steps // 10) == 0:
            _progress(f"step {step + 1}/{args.steps}, loss {losses[-1]:.3f}")
    model.eval()
    return losses


# --------------------------------------------------------------------------------------------- evaluation
def sample_responses(model: Any, item: PromptItem, processor: PromptProcessor, args: WarmupArgs) -> list[str]:
    """``samples_per_prompt`` responses at temperature 1 (no top-k / top-p), special tokens dropped."""
    import torch

    with torch.no_grad():
        out = model.generate(
            input_ids=item.input_ids[None],
            attention_mask=torch.ones_like(item.input_ids)[None],
            mm_token_type_ids=hf_token_types(item.input_ids[None], tiny.IMAGE_TOKEN_ID),
            pixel_values=item.pixel_values,
            image_grid_thw=item.image_grid_thw,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=args.max_new_tokens,
            num_return_sequences=args.samples_per_prompt,
        )
    new = out[:, item.input_ids.shape[0] :]
    return processor.tokenizer.batch_decode(new, skip_special_tokens=True)


def evaluate(model: Any, items: list[PromptItem], processor: PromptProcessor, args: WarmupArgs) -> dict[str, float]:
    """Mean format, accuracy and score of sampled responses, and ``restates``: the share whose reasoning restates
    the question's numbers (seeded, so repeatable)."""
    from mm_rl.rewards.geo3k import compute_score

    scores = []
    for item in items:
        givens = f"<think> {' '.join(given_numbers(item.prompt_text))} </think>"
        for response in sample_responses(model, item, processor, args):
            scores.append(compute_score(response, item.ground_truth) | {"restates": float(response.startswith(givens))})
    return {
        key: round(sum(s[key] for s in scores) / len(scores), 6) for key in ("format", "accuracy", "score", "restates")
    }


# ---------------------------------------------------------------------------------------------------- files
def _save_weights(model: Any, hf_dir: Path) -> None:
    """Rewrite ``model.safetensors`` in place (temp file + rename) with the builder's key names and metadata."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(hf_dir / _WEIGHTS, "pt") as f:
        expected = set(f.keys())
    with tempfile.TemporaryDirectory(prefix=".warmup-", dir=hf_dir) as staging:
        model.save_pretrained(staging, safe_serialization=True)  # published key names (model.layers.*, visual.*)
        with safe_open(Path(staging) / _WEIGHTS, "pt") as f:
            weights = {name: f.get_tensor(name).to(torch.float32).contiguous() for name in sorted(f.keys())}
    weights = tiny.to_published(family_for_hf(_read_json(hf_dir / "config.json") or {}), model, weights)
    if set(weights) != expected:
        raise RuntimeError(f"saved keys differ from the checkpoint's: {sorted(set(weights) ^ expected)[:5]}")
    with atomic_path(hf_dir / _WEIGHTS, suffix=".tmp", mode=0o644) as tmp:
        save_file(weights, tmp, metadata={"format": "pt"})


def _marker_args(hf_dir: Path, data_dir: Path, args: Any, version: int) -> dict[str, Any]:
    base = _read_json(hf_dir / "tiny_build.json")
    if base is None:
        raise ValueError(f"{hf_dir} is not a tiny checkpoint (no tiny_build.json); build it with build_tiny_checkpoint")
    data = _read_json(data_dir / "synthetic_geo3k.json") or {}
    record = {"version": version, **asdict(args), "build": base, "data": data.get("args", str(data_dir))}
    return json.loads(json.dumps(record, sort_keys=True))


def _stored_metrics(hf_dir: Path, record: dict[str, Any]) -> dict[str, Any] | None:
    """The metrics of a finished warm-up with these arguments; None when there is none; error on a mismatch."""
    marker = _read_json(hf_dir / MARKER)
    if marker is None or "metrics" not in marker:
        return None
    if marker.get("args") != record:
        raise ValueError(
            f"{hf_dir} was already warmed up with other arguments ({marker.get('args')}); warming up again would "
            "stack on those weights: build a fresh checkpoint with build_tiny_checkpoint first"
        )
    return marker["metrics"]


# ------------------------------------------------------------------------------------------------------ api
def warm_up_format(
    hf_dir: str | Path,
    data_dir: str | Path,
    steps: int = WarmupArgs.steps,
    seed: int = 0,
    report: Callable[[str], None] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Teach the tiny checkpoint in ``hf_dir`` the geo3k output format and an off-by-one answer habit, in place.

    ``data_dir`` holds the synthetic set (``write_synthetic_geo3k``). ``options`` override the other
    ``WarmupArgs`` fields (lr, batch_size, train_prompts, eval_prompts, samples_per_prompt, max_new_tokens,
    min_pixels, max_pixels, max_prompt_length). Returns ``{"before": {...}, "after": {...}, "wall_time_s",
    "losses": [first, last], "args"}`` where before/after hold the mean format, accuracy and score of
    ``eval_prompts x samples_per_prompt`` sampled test responses. A second call with the same arguments returns
    the stored metrics and changes nothing. ``report`` receives progress lines while a warm-up runs (a few
    minutes on 2 cores): its phases and every tenth of its steps.
    """
    args = WarmupArgs(steps=steps, seed=seed, **options)
    return warm_up(Warmup("tiny-warmup", _VERSION, __name__, _sources), Path(hf_dir), Path(data_dir), args, report)


@dataclass(frozen=True)
class Warmup:
    """A kind of warm-up: its cache name, version, the module whose ``__main__`` runs it (in a child process, see
    :func:`_run_pinned`) and the modules that determine its result (``sources(record)``, the cache key)."""

    kind: str
    version: int
    module: str
    sources: Callable[[dict[str, Any]], list[str]]


def warm_up(
    warmup: Warmup, hf_dir: Path, data_dir: Path, args: Any, report: Callable[[str], None] | None
) -> dict[str, Any]:
    """Run ``warmup`` with ``args`` (a dataclass) on the checkpoint in ``hf_dir``, in place, once per machine: the
    weights and the marker come from the cache (:mod:`mm_rl.cache`) when the same warm-up of the same build on the
    same data ran before. Returns the metrics; a second call with the same arguments changes nothing."""
    hf_dir, data_dir = hf_dir.absolute(), data_dir.absolute()
    record = _marker_args(hf_dir, data_dir, args, warmup.version)
    stored = _stored_metrics(hf_dir, record)
    if stored is not None:
        return stored
    if not isinstance(record["data"], dict):  # not the synthetic set: nothing names the data, so no cache key
        return _warm_in_place(hf_dir, data_dir, args, record, report, warmup.module)
    warmed = cache.entry(
        cache.key(warmup.kind, record, warmup.sources(record)),
        lambda staging: _warm_copy(staging, hf_dir, data_dir, args, record, report, warmup.module),
    )
    with atomic_path(hf_dir / _WEIGHTS, suffix=".tmp", mode=0o644) as tmp:  # weights first, the marker last
        shutil.copyfile(warmed / _WEIGHTS, tmp)
    write_atomic(hf_dir / MARKER, (warmed / MARKER).read_bytes(), sync=False, suffix=".tmp")
    return json.loads((warmed / MARKER).read_text(encoding="utf-8"))["metrics"]


def _sources(record: dict[str, Any]) -> list[str]:
    """The modules whose code determines the warmed weights and metrics (the cache key): the warm-up, the data it
    reads (the synthetic set's writer, the prompt processing), the reward it measures, and the tiny builder."""
    return [
        __name__,
        "mm_rl.demo.synthetic",
        "mm_rl.data.dataset",
        "mm_rl.rewards.geo3k",
        *tiny.build_sources(record["build"]["family"]),
    ]


def _warm_copy(
    staging: Path, hf_dir: Path, data_dir: Path, args: Any, record: dict[str, Any], report: Reporter, module: str
) -> None:
    """A warmed copy of ``hf_dir`` in ``staging`` (a cache entry being built); ``hf_dir`` is left alone."""
    for path in hf_dir.iterdir():
        if path.is_file():
            shutil.copy2(path, staging / path.name)
    _warm_in_place(staging, data_dir, args, record, report, module)


def _warm_in_place(
    hf_dir: Path, data_dir: Path, args: Any, record: dict[str, Any], report: Reporter, module: str
) -> dict[str, Any]:
    metrics = _run_pinned(hf_dir, data_dir, args, report, module)
    marker = {"args": record, "metrics": metrics}
    write_atomic(hf_dir / MARKER, json.dumps(marker, indent=2, sort_keys=True) + "\n", sync=False, suffix=".tmp")
    return metrics


def _run_pinned(
    hf_dir: Path, data_dir: Path, args: Any, report: Reporter = None, module: str = __name__
) -> dict[str, Any]:
    """``module``'s warm-up (its ``__main__``: HF_DIR DATA_DIR ARGS_JSON, the metrics as JSON on stdout) in a child
    process whose CPU kernels are pinned (``KERNEL_ENV``): the copy skill appears abruptly, and the instruction
    set's rounding decides whether it has by step 500. Returns its metrics; the child's progress lines go to
    ``report`` as they come."""
    import collections
    import os
    import subprocess
    import sys

    command = [sys.executable, "-m", module, str(hf_dir), str(data_dir), json.dumps(asdict(args))]
    child = subprocess.Popen(
        command, env=os.environ | KERNEL_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stderr is not None
    tail: collections.deque[str] = collections.deque(maxlen=40)
    for line in child.stderr:  # stdout holds only the final metrics line: it cannot fill its pipe meanwhile
        if line.startswith(_PROGRESS):
            if report is not None:
                report(line.removeprefix(_PROGRESS).strip())
        else:
            tail.append(line)
    out = child.stdout.read()
    if child.wait() != 0:
        raise RuntimeError(f"the tiny warm-up failed (exit {child.returncode}): {''.join(tail).strip()[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


_PROGRESS = "mm_rl-progress: "  # the child's progress lines on stderr, passed on to the parent's report
Reporter = Callable[[str], None] | None


def _progress(text: str, what: str = "tiny warm-up") -> None:
    """A progress line of the child for its parent (:func:`_run_pinned`)."""
    import sys

    print(f"{_PROGRESS}{what}: {text}", file=sys.stderr, flush=True)


def _run(hf_dir: Path, data_dir: Path, args: WarmupArgs) -> dict[str, Any]:
    from mm_rl.platform import cpu_wheels

    cpu_wheels.install()  # transformers' image utilities import torchvision when it is installed
    from transformers import AutoModelForImageTextToText

    from mm_rl.data.dataset import PromptProcessor

    start = time.perf_counter()
    with _one_thread_seeded(args.seed), tiny.quiet_progress():
        processor = PromptProcessor(hf_dir, args.min_pixels, args.max_pixels)
        train = _load_items(data_dir, "train", args.train_prompts, processor, args)
        test = _load_items(data_dir, "test", args.eval_prompts, processor, args)
        model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype="float32").eval()
        _progress(f"scoring {len(test)} test prompts before")
        before = _seeded(args.seed + 1, lambda: evaluate(model, test, processor, args))
        losses = _seeded(args.seed, lambda: _train(model, train, processor, args))
        _progress(f"scoring {len(test)} test prompts after")
        after = _seeded(args.seed + 1, lambda: evaluate(model, test, processor, args))  # same seed as before
        _save_weights(model, hf_dir)
    return {
        "before": before,
        "after": after,
        "losses": [round(losses[0], 4), round(losses[-1], 4)] if losses else [],
        "wall_time_s": round(time.perf_counter() - start, 2),
        "args": asdict(args),
    }


def _seeded(seed: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` with the torch RNG seeded to ``seed``, so a phase does not depend on what ran before it."""
    import torch

    torch.manual_seed(seed)
    return fn()


if __name__ == "__main__":  # the child of _run_pinned: HF_DIR DATA_DIR ARGS_JSON; prints the metrics as JSON
    import sys

    _hf, _data, _args = sys.argv[1:4]
    print(json.dumps(_run(Path(_hf), Path(_data), WarmupArgs(**json.loads(_args)))))
