"""A tiny checkpoint of a model family, built offline and deterministically, for tests and CPU runs.

``build_tiny_checkpoint(out_dir, seed, family=...)`` writes a complete HuggingFace checkpoint directory (config,
safetensors weights, byte-level BPE tokenizer, chat template, image processor, generation config) that
transformers' ``AutoProcessor`` / the family's ``...ForConditionalGeneration`` and vLLM load like a published
checkpoint. Nothing is downloaded: the tokenizer is trained here on a small embedded geometry corpus and the
weights are random. The family's ``tiny`` module gives its HF config class and sizes (the Qwen2.5-VL default:
``mm_rl.models.qwen2_5_vl.tiny``); the tokenizer, chat template and special-token ids are shared.

Why these sizes (the real architecture, shrunk so every code path still runs):
- Text: head_dim = 128 / 4 = 32, and mrope_section [4, 6, 6] sums to head_dim / 2 as mRoPE requires (temporal,
  height and width sections of the rotary frequencies).
- 4 query heads in 2 KV groups (GQA): TP=2 gives each rank one whole group, as the interleaved qkv layout needs;
  4 layers split over PP=2 or PP=4.
- Vocabulary 1024 (1000 learned BPE ids + 11 fixed tokens, padded to a multiple of 128 like Qwen's 151936): the
  vocab-parallel log-prob and the output layer are cheap on CPU, and 1024 splits evenly for TP=2/4.

Weights are drawn per tensor from a generator seeded by (seed, tensor name), so the same seed gives the same
bytes and changing one size leaves the other tensors' values alone. A build goes into the per-machine cache
(``mm_rl.cache``, keyed by the arguments, this builder's and the family's sources and the library versions) and is
copied from there into ``out_dir``, swapped in whole; a marker file records the build arguments so a matching
checkpoint already in ``out_dir`` is reused as it is.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mm_rl import cache

if TYPE_CHECKING:
    from mm_rl.config.schema import ModelConfig
from mm_rl.models.family import ModelFamily, name_pattern
from mm_rl.models.qwen_vl import tensors
from mm_rl.models.registry import family as model_family

# Fixed token ids (the learned BPE vocabulary is ids 0..999).
NUM_LEARNED_TOKENS = 1000
ENDOFTEXT_TOKEN_ID = 1000
IM_START_TOKEN_ID = 1001
IM_END_TOKEN_ID = 1002
VISION_START_TOKEN_ID = 1003
VISION_END_TOKEN_ID = 1004
VISION_PAD_TOKEN_ID = 1005
IMAGE_TOKEN_ID = 1006
VIDEO_TOKEN_ID = 1007
THINK_START_TOKEN_ID = 1008
THINK_END_TOKEN_ID = 1009
BOXED_TOKEN_ID = 1010
EOS_TOKEN_ID = IM_END_TOKEN_ID
PAD_TOKEN_ID = ENDOFTEXT_TOKEN_ID
VOCAB_SIZE = 1024

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
ADDED_TOKENS: tuple[str, ...] = ("<think>", "</think>", "\\boxed{")

IMAGE_PROCESSOR_CONFIG: dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 3136,
    "max_pixels": 50176,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Qwen2.5-VL chat format. Content is a string or a list of parts ({"type": "image"} / {"type": "text", ...}).
CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' or 'video' in part -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in part -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# Qwen2's pre-tokenizer split; transformers' Qwen2Tokenizer re-creates this pipeline on load, so train with it.
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_MARKER = "tiny_build.json"
_BUILDER_VERSION = 1
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "preprocessor_config.json",
    "chat_template.jinja",
)

_WORDS = """
triangle triangles angle angles side sides length lengths circle circles radius radii diameter area areas perimeter
find measure measures degree degrees value values segment segments line lines point points center chord chords
tangent secant arc arcs sector square squares rectangle parallelogram rhombus trapezoid kite polygon hexagon pentagon
octagon quadrilateral vertex vertices altitude median bisector perpendicular parallel congruent similar right acute
obtuse isosceles equilateral scalene hypotenuse leg legs base bases height width diagonal diagonals inscribed
circumscribed midpoint ratio proportion sine cosine theorem pythagorean round nearest tenth hundredth whole number
answer think solve given figure shown each the of a an and is are in if to what which that with by from for on at
as or not be it its this these those use express simplest radical form units centimeters meters inches feet yards
total sum difference product quotient equal equals exterior interior opposite adjacent supplementary complementary
vertical corresponding alternate circumference volume surface prism cylinder cone sphere cube regular shaded region
therefore so we have then since because let assume substitute compute calculate step first second third final
reasoning process internal monologue provide put enclosed within tags must half twice times plus minus divided
multiply subtract add known unknown variable solution check correct option choice triangle's circle's
""".split()
_LATEX = r"""
\frac{1}{2} \frac{a}{b} \sqrt{3} \sqrt{2} \sqrt{x} \pi \angle \triangle \cdot \times ^{\circ} x^2 + y^2 = z^2
\sin \cos \tan \overline{AB} \parallel \perp \cong \sim \approx \leq \geq \left( \right) \text{cm} \text{in}
""".split()
_TEMPLATES = (
    "Find the measure of angle {a}{b}{c}. Round to the nearest tenth.",
    "In triangle {a}{b}{c}, side {a}{b} = {n} and {b}{c} = {m}. Find the length of {a}{c}.",
    "The radius of circle {a} is {n} centimeters. What is the area of the circle?",
    "Find the perimeter of the square with side length {n} inches.",
    "If m \\angle {a}{b}{c} = {n}^{{\\circ}}, find x so that the lines are parallel.",
    "Chord {a}{b} is a diameter, so the arc {a}{c}{b} measures 180 degrees.",
    "Let x = {n}. Then \\frac{{x}}{{{m}}} = \\sqrt{{{n}}} and the answer is {m}.",
    "<think> The hypotenuse is \\sqrt{{{n}^2 + {m}^2}}. </think> The answer is \\boxed{{{n}}}.",
    "Use the Pythagorean theorem: a^2 + b^2 = c^2, so c = {n}.",
    "Express the answer in simplest radical form: {n} \\sqrt{{{m}}}.",
)


def _corpus() -> list[str]:
    """Deterministic geometry-flavoured text for training the tokenizer (no randomness, no files)."""
    lines = [" ".join(_WORDS), " ".join(w.capitalize() for w in _WORDS), " ".join(_LATEX)]
    letters = itertools.cycle("ABCDEFGHJKLMNPQRSTUVWXYZ")
    for index, (template, n, m) in enumerate(itertools.product(_TEMPLATES, (3, 12, 45), (7, 60))):
        a, b, c = next(letters), next(letters), next(letters)
        lines.append(template.format(a=a, b=b, c=c, n=n + index, m=m))
    return lines


def _train_tokenizer() -> Any:
    """Byte-level BPE with exactly NUM_LEARNED_TOKENS learned ids, then the fixed special and added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=NUM_LEARNED_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    if tokenizer.get_vocab_size() != NUM_LEARNED_TOKENS:
        raise RuntimeError(f"tokenizer learned {tokenizer.get_vocab_size()} ids, expected {NUM_LEARNED_TOKENS}")
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    expected = dict(zip(SPECIAL_TOKENS + ADDED_TOKENS, range(ENDOFTEXT_TOKEN_ID, BOXED_TOKEN_ID + 1), strict=True))
    actual = {token: tokenizer.token_to_id(token) for token in expected}
    if actual != expected:
        raise RuntimeError(f"fixed token ids came out as {actual}")
    return tokenizer


def _model_config(family: ModelFamily, tie_word_embeddings: bool, overrides: dict[str, Any]) -> Any:
    """The family's HF config; flat overrides change text fields, ``vision_config={...}`` changes vision fields."""
    module = family.tiny_module()
    overrides = dict(overrides)
    vision = {**module.VISION_CONFIG, **overrides.pop("vision_config", {})}
    text = {**module.TEXT_CONFIG, **overrides}
    unknown = sorted((set(text) - set(module.TEXT_CONFIG)) | (set(vision) - set(module.VISION_CONFIG)))
    if unknown:
        raise TypeError(
            f"unknown tiny-model overrides {unknown}; fields: {sorted(module.TEXT_CONFIG)}, "
            f"{sorted(module.VISION_CONFIG)}"
        )
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    rotary = int(head_dim * text.get("partial_rotary_factor", 1.0))
    if sum(text["mrope_section"]) * 2 != rotary:
        raise ValueError(f"mrope_section {text['mrope_section']} must sum to the rotary dim / 2 = {rotary // 2}")
    if text["num_attention_heads"] % text["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if text["vocab_size"] <= BOXED_TOKEN_ID:
        raise ValueError(f"vocab_size must exceed {BOXED_TOKEN_ID}")
    ids = {"bos_token_id": ENDOFTEXT_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": PAD_TOKEN_ID}
    rope = {"rope_type": "default", "rope_theta": text.pop("rope_theta"), "mrope_section": text.pop("mrope_section")}
    text_config = {
        **text,
        **ids,
        "rope_parameters": rope,
        "tie_word_embeddings": tie_word_embeddings,
        "dtype": "float32",
    }
    return module.hf_config(
        text_config=text_config,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_TOKEN_ID,
        vision_end_token_id=VISION_END_TOKEN_ID,
        tie_word_embeddings=tie_word_embeddings,
        dtype="float32",
        **ids,
    )


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """No transformers progress bars (loading / writing weights) inside; the previous setting restored after."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def _init_tensor(seed: int, name: str, like: Any, std: float = 0.02) -> Any:
    """Normal(0, std) for matrices, embeddings and convolutions; ones for norm weights; zeros for biases."""
    import torch

    if name.endswith(".bias"):
        return torch.zeros_like(like)
    if like.dim() == 1:
        return torch.ones_like(like)
    generator = torch.Generator().manual_seed(_tensor_seed(seed, name))
    return (torch.randn(like.shape, generator=generator, dtype=torch.float32) * std).to(like.dtype)


def _write_checkpoint(
    directory: Path, family: ModelFamily, seed: int, tie_word_embeddings: bool, overrides: dict[str, Any]
) -> None:
    from mm_rl.platform import cpu_wheels

    cpu_wheels.install()  # transformers' image utilities import torchvision when it is installed
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers import GenerationConfig

    config = _model_config(family, tie_word_embeddings, overrides)
    with torch.random.fork_rng(devices=[]):  # transformers' own init draws from (and would move) the global RNG
        model = transformers.AutoModelForImageTextToText.from_config(config).to(torch.float32)
    # save_pretrained gives the published key names (model.layers.*, visual.*, lm_head unless tied); the values
    # are then redrawn per key name, so they depend only on (seed, name, shape), not on transformers' internals.
    with quiet_progress():
        model.save_pretrained(directory, safe_serialization=True)
    weights_file = directory / "model.safetensors"
    weights = to_published(
        family,
        model,
        {name: _init_tensor(seed, name, tensor) for name, tensor in sorted(load_file(weights_file).items())},
    )
    save_file(weights, weights_file, metadata={"format": "pt"})
    GenerationConfig(
        bos_token_id=ENDOFTEXT_TOKEN_ID, eos_token_id=[EOS_TOKEN_ID, ENDOFTEXT_TOKEN_ID], pad_token_id=PAD_TOKEN_ID
    ).save_pretrained(directory)

    _train_tokenizer().save(str(directory / "tokenizer.json"))
    flags = {"lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
    added = {
        str(i): {"content": token, **flags, "special": token in SPECIAL_TOKENS}
        for i, token in enumerate(SPECIAL_TOKENS + ADDED_TOKENS, start=ENDOFTEXT_TOKEN_ID)
    }
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "split_special_tokens": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.get_text_config().max_position_embeddings,
        "processor_class": family.tiny_module().PROCESSOR_CLASS,
    }
    _write_json(directory / "tokenizer_config.json", tokenizer_config)
    processor = {
        **IMAGE_PROCESSOR_CONFIG,
        **family.tiny_module().IMAGE_PROCESSOR,
        "processor_class": tokenizer_config["processor_class"],
    }
    _write_json(directory / "preprocessor_config.json", processor)
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


def to_published(family: ModelFamily, model: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` (as ``save_pretrained`` wrote them) with fused experts tensors in the published layout
    ([E, in, k * out]): transformers 5.19 keeps [E, k * out, in] in memory and writes that as it is, which vLLM
    (``is_fused_checkpoint_transposed``: it transposes unconditionally) would misread. A tensor is transposed when
    it has its in-memory parameter's shape."""
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    return {
        name: tensor.transpose(1, 2).contiguous()
        if any(name_pattern(rule.stored).match(name) for rule in family.hf_fused)
        and tuple(tensor.shape) == shapes.get(name)
        else tensor
        for name, tensor in weights.items()
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _build_args(family: str, seed: int, tie_word_embeddings: bool, overrides: dict[str, Any]) -> dict[str, Any]:
    args = {"version": _BUILDER_VERSION, "family": family, "seed": seed, "tie_word_embeddings": tie_word_embeddings}
    # A JSON round trip normalises the arguments (tuples become lists) as they will be read back from the marker.
    return json.loads(json.dumps({**args, "config_overrides": overrides}, sort_keys=True))


def _is_complete(directory: Path, args: dict[str, Any]) -> bool:
    marker = directory / _MARKER
    if not marker.is_file() or not all((directory / name).is_file() for name in _REQUIRED_FILES):
        return False
    try:
        return json.loads(marker.read_text(encoding="utf-8")) == args
    except (OSError, ValueError):
        return False


def tiny_overrides(model: ModelConfig) -> dict[str, Any]:
    """The builder's overrides for the tiny variant a tiny model.json describes (the MoE sizes; none else)."""
    text = model.text_decoder
    if not text.num_moe_experts:
        return {}
    shared = {"shared_expert_intermediate_size": text.moe_shared_expert_intermediate_size}
    return {
        "num_experts": text.num_moe_experts,
        "num_experts_per_tok": text.moe_router_topk,
        "moe_intermediate_size": text.moe_intermediate_size,
        **(shared if text.moe_shared_expert_intermediate_size else {}),
    }


def build_tiny_checkpoint(
    out_dir: str | Path,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    family: str = "qwen2_5vl",
    **config_overrides: Any,
) -> Path:
    """Build (or reuse) the tiny checkpoint of model family ``family`` (a model.json ``model_id``) in ``out_dir``
    and return its path.

    ``config_overrides`` change text-model fields (e.g. ``num_hidden_layers=2``); ``vision_config={...}`` changes
    vision fields. An existing ``out_dir`` built with the same arguments is reused as is; one built by this
    function with other arguments is replaced; any other non-empty ``out_dir`` is an error.
    """
    out_dir = Path(out_dir).absolute()
    args = _build_args(family, seed, tie_word_embeddings, config_overrides)
    if _is_complete(out_dir, args):
        return out_dir
    if out_dir.exists() and not (out_dir / _MARKER).is_file() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not a tiny checkpoint; refusing to overwrite it")
    built = cache.entry(
        cache.key("tiny", args, build_sources(family)),
        lambda staging: _build_into(staging, family, seed, tie_word_embeddings, config_overrides, args),
    )
    try:  # an existing out_dir (empty, or an older tiny build) is moved aside and removed
        cache.copy_out(built, out_dir)
    except OSError:
        if not _is_complete(out_dir, args):  # lost a race only if the winner built the same thing
            raise
    return out_dir


def build_sources(family: str) -> list[str]:
    """The modules whose code determines a tiny checkpoint's bytes (its cache key): this builder, the family's
    tiny sizes and its tensor rules (the published fused layout), with the table pieces the Qwen-VL families share."""
    chosen = model_family(family)
    return [
        __name__,
        "mm_rl.models.family",
        chosen.tiny_module().__name__,
        chosen.model_json.__module__,
        tensors.__name__,
    ]


def _build_into(
    staging: Path, family: str, seed: int, tie_word_embeddings: bool, overrides: dict[str, Any], args: dict[str, Any]
) -> None:
    _write_checkpoint(staging, model_family(family), seed, tie_word_embeddings, overrides)
    _write_json(staging / _MARKER, args)  # written last: its presence means the directory is complete
    for path in staging.iterdir():  # some writers create 0600 files
        path.chmod(0o644)
