"""Write a HuggingFace checkpoint: safetensors shards streamed tensor by tensor, the index, and the side files.

Every tensor's name, shape and dtype is known before the first byte is written, so each shard's header is
written first and a tensor's bytes go to disk as soon as it is produced: memory holds one tensor, not a shard.
The file format is safetensors': an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
data offsets; padded with spaces to a multiple of 8) and the tensors' bytes back to back.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from mm_rl.config.schema import ModelConfig
from mm_rl.convert.errors import ConversionError

INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
    "chat_template.jinja",
)
SIDE_PATTERNS = ("chat_template*.jinja", "chat_template*.json")
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


def plan_shards(specs: Sequence[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive groups of at most ``max_shard_bytes`` (a larger tensor gets a shard of its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return [s for s in shards if s]


class ShardedWriter:
    """Writes the tensors of ``specs``, in that order, into ``model-XXXXX-of-YYYYY.safetensors`` files."""

    def __init__(self, out_dir: Path, specs: Sequence[TensorSpec], max_shard_bytes: int) -> None:
        self.dir = out_dir
        self.shards = plan_shards(specs, max_shard_bytes)
        self.names = [f"model-{k + 1:05d}-of-{len(self.shards):05d}.safetensors" for k in range(len(self.shards))]
        self._shard = -1
        self._pos = 0
        self._file: BinaryIO | None = None

    def write(self, name: str, blocks: Sequence[torch.Tensor]) -> None:
        """Write tensor ``name``, given as blocks whose concatenation along dim 0 is the tensor (one block, or
        row ranges of several shards, which are never assembled in memory)."""
        if self._file is None or self._pos == len(self.shards[self._shard]):
            self._next_shard()
        spec = self.shards[self._shard][self._pos]
        shape = (sum(b.shape[0] for b in blocks), *blocks[0].shape[1:]) if blocks[0].dim() else ()
        if (name, shape) != (spec.name, spec.shape) or any(
            b.dtype != spec.dtype or b.shape[1:] != blocks[0].shape[1:] for b in blocks
        ):
            raise ConversionError(f"internal: expected {spec} next, got {name} {list(shape)} {blocks[0].dtype}")
        assert self._file is not None
        for block in blocks:
            data = block.detach().contiguous().reshape(-1).view(torch.uint8)
            self._file.write(memoryview(data.numpy()))
        self._pos += 1

    def _next_shard(self) -> None:
        self._close_file()
        self._shard += 1
        self._pos = 0
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for spec in self.shards[self._shard]:
            header[spec.name] = {
                "dtype": _DTYPES[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._file = open(self.dir / self.names[self._shard], "wb")  # closed in _close_file
        self._file.write(struct.pack("<Q", len(raw)) + raw)

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def finish(self) -> None:
        """Check every tensor was written, close the last shard and write the index."""
        written = self._shard == len(self.shards) - 1 and self._pos == len(self.shards[-1])
        self._close_file()
        if not written:
            raise ConversionError("internal: the HF writer was finished before every tensor was written")
        weight_map = {spec.name: file for file, shard in zip(self.names, self.shards, strict=True) for spec in shard}
        total = sum(spec.nbytes for shard in self.shards for spec in shard)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")

    def abort(self) -> None:
        self._close_file()


def copy_side_files(src: Path, dst: Path, model: ModelConfig) -> list[str]:
    """Copy the config, generation config, tokenizer, processor and chat template files of ``src``.

    config.json becomes the job's model's (``ModelFamily.hf_config``: layer counts, activation, rope), rewritten only
    where model.json changed something, so the result loads as the model that was trained."""
    names = {n for n in SIDE_FILES if (src / n).is_file()}
    names |= {p.name for pattern in SIDE_PATTERNS for p in src.glob(pattern) if p.is_file()}
    if "config.json" not in names:
        raise ConversionError(f"{src / 'config.json'} is missing: the output would not load in transformers")
    for name in sorted(names):
        shutil.copyfile(src / name, dst / name)
    write_model_config(dst / "config.json", model)
    return sorted(names)


def write_model_config(path: Path, model: ModelConfig) -> bool:
    """Rewrite the HF config.json at ``path`` as the job's model's; False (untouched) when it already is."""
    from mm_rl.models.registry import family_of

    config = json.loads(path.read_text())
    wanted = family_of(model).hf_config(config, model)
    if wanted == config:
        return False
    path.write_text(json.dumps(wanted, indent=2, sort_keys=True) + "\n")
    return True


def job_model_dir(src: Path, model: ModelConfig, dst: Path) -> Path:
    """``src`` when it holds the job's model as it is; else ``dst``, the same checkpoint as the job's model.json
    describes it: config.json rewritten (``write_model_config``: fewer layers, another rope, a narrower LLM), the
    tensors of the layers model.json drops left out, the tensors it narrows or regroups cut as hf2mg cuts them
    (``mm_rl.convert.reshape``); weight files with no such tensor are linked. For an engine that must build the
    model the actor trains and load its start weights (vLLM refuses a tensor its model has no place for), and for
    transformers to load the model hf2mg converted."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from mm_rl.convert.mapping import dropped_layer, published_name
    from mm_rl.convert.reshape import plan_reshape
    from mm_rl.files import replace_dir, unique_sibling
    from mm_rl.models.registry import family_of

    probe = json.loads((src / "config.json").read_text())
    reshape = plan_reshape(src, model)
    dropped: dict[str, set[str]] = {}
    rewritten: set[str] = set()
    for weights in sorted(src.glob("*.safetensors")):
        with safe_open(weights, "pt") as handle:
            names = {published_name(model, n): n for n in handle.keys()}  # noqa: SIM118
        gone = {stored for name, stored in names.items() if dropped_layer(model, name)}
        if gone:
            dropped[weights.name] = gone
        if gone or (reshape is not None and any(reshape.changes(name) for name in names)):
            rewritten.add(weights.name)
    if family_of(model).hf_config(probe, model) == probe and not rewritten:
        return src
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = unique_sibling(dst, f".{dst.name}.tmp-")
    staging.mkdir()
    for path in src.iterdir():
        if path.is_file() and path.name not in {"config.json", INDEX, *rewritten}:
            (staging / path.name).symlink_to(path.resolve())
    for name in sorted(rewritten):  # one weight file in memory at a time
        kept: dict[str, torch.Tensor] = {}
        with safe_open(src / name, "pt") as handle:
            for stored in handle.keys():  # noqa: SIM118
                if stored not in dropped.get(name, ()):
                    tensor = handle.get_tensor(stored)
                    published = published_name(model, stored)
                    kept[stored] = reshape.tensor(published, tensor) if reshape is not None else tensor
        save_file(kept, str(staging / name), metadata={"format": "pt"})
    if (src / INDEX).is_file():
        index = json.loads((src / INDEX).read_text())
        gone = set().union(*dropped.values()) if dropped else set()
        index["weight_map"] = {n: f for n, f in index["weight_map"].items() if n not in gone}
        index.get("metadata", {}).pop("total_size", None)  # no longer the sum of the tensors' bytes
        (staging / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    shutil.copyfile(src / "config.json", staging / "config.json")
    write_model_config(staging / "config.json", model)
    replace_dir(staging, dst)
    return dst
