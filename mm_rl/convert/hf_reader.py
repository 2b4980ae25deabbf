"""Read a HuggingFace safetensors checkpoint by slices, never whole.

The index (``model.safetensors.index.json``, or the headers of the ``*.safetensors`` files when there is none)
says which file holds each tensor; every header is read once up front so shapes are known before any data is
read. ``read`` returns a range of rows or columns as a view of the file's memory map: only the pages of that
range are read. One file is open at a time, and closing it drops its pages from the process, so the memory a
conversion needs for input is at most one input file, however large the checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from mm_rl.convert.errors import ConversionError, listing
from mm_rl.convert.pages import prefault
from mm_rl.convert.reshape import Reshape
from mm_rl.models.family import Fused, name_pattern

INDEX = "model.safetensors.index.json"


class HfReader:
    """Shapes, dtypes and slices of the tensors of one HF checkpoint directory, by published name."""

    def __init__(
        self,
        hf_dir: str | Path,
        canonical: Callable[[str], str] = str,
        fused: tuple[Fused, ...] = (),
        part_shapes: Mapping[str, tuple[int, ...]] | None = None,
        reshape: Reshape | None = None,
    ) -> None:
        """``canonical``: a stored tensor name -> its published name (the family's other spellings); ``fused``:
        stored tensors that are read as their per-expert parts (each part a view, nothing assembled), whose
        shapes ``part_shapes`` gives (to tell the published layout from transformers' in-memory one);
        ``reshape``: the job's model is cut from this checkpoint (``mm_rl.convert.reshape``): the tensors it
        changes have the job's shapes and are read whole, cut, then sliced."""
        self.dir = Path(hf_dir)
        self.canonical = canonical
        self.file: dict[str, str] = {}  # published name -> file name
        self.stored: dict[str, str] = {}  # published name -> name in the file
        self.shape: dict[str, tuple[int, ...]] = {}
        self.dtype: dict[str, str] = {}
        self._open: tuple[str, Any] | None = None
        self.parts: dict[str, tuple[int, int, bool]] = {}  # part name -> (expert, part, stored as in memory)
        for file_name, names in self._files().items():
            self._read_header(file_name, names)
        for rule in fused:
            self._split_fused(rule, part_shapes or {})
        self.reshape = reshape
        self._stored_rows: dict[str, int] = {}
        self._cut: tuple[str, torch.Tensor] | None = None  # the last tensor cut (TP pieces read it again)
        for name in sorted(self.shape):
            if reshape is not None and reshape.changes(name):
                if name in self.parts:
                    raise ConversionError(f"internal: {name} is stored fused with other experts and cannot be cut")
                self._stored_rows[name] = self.shape[name][0]
                self.shape[name] = reshape.shape(name, self.shape[name])

    def _split_fused(self, rule: Fused, part_shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Replace each stored tensor ``rule`` matches by its per-expert parts (names, shapes, where they lie).

        Published checkpoints store [E, in, k * out] (each part transposed); transformers 5.19 keeps
        [E, k * out, in] in memory and ``save_pretrained`` may write that back (its ``Transpose(check_dims=True)``
        conversion compares shapes, so a re-saved model keeps the in-memory layout). Both are read: the part
        shapes decide, the published layout when both fit (a square tensor)."""
        pattern = name_pattern(rule.stored)
        for name in sorted(self.names):
            match = pattern.match(name)
            if match is None:
                continue
            experts, rows, columns = self.shape[name]
            k = len(rule.parts)
            want = part_shapes.get(rule.parts[0].format(i=match["i"], e=0))
            in_memory = (
                want is not None
                and (rows, columns) != (want[1], k * want[0])
                and (rows, columns) == (k * want[0], want[1])
            )
            width, depth = (rows, columns) if in_memory else (columns, rows)
            if width % k:
                raise ConversionError(
                    f"{name} in {self.file[name]}: shape {list(self.shape[name])} does not split into {k} parts"
                )
            for e in range(experts):
                for j, part in enumerate(rule.parts):
                    virtual = part.format(i=match["i"], e=e)
                    self.file[virtual], self.stored[virtual] = self.file[name], self.stored[name]
                    self.shape[virtual], self.dtype[virtual] = (width // k, depth), self.dtype[name]
                    self.parts[virtual] = (e, j, in_memory)
            for table in (self.file, self.stored, self.shape, self.dtype):
                del table[name]

    def _files(self) -> dict[str, set[str] | None]:
        """file name -> the tensor names the index assigns to it (None: whatever the file holds)."""
        if not self.dir.is_dir():
            raise ConversionError(f"HuggingFace checkpoint directory {self.dir} does not exist")
        index = self.dir / INDEX
        if index.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise ConversionError(f"{index} is not a safetensors index ({err!r})") from None
            files: dict[str, set[str] | None] = {}
            for name, file_name in weight_map.items():
                files.setdefault(file_name, set()).add(name)  # type: ignore[union-attr]
            missing = sorted(f for f in files if not (self.dir / f).is_file())
            if missing:
                raise ConversionError(
                    f"{index} names files that are missing (an incomplete download or copy?):\n" + listing(missing)
                )
            return files
        found = sorted(p.name for p in self.dir.glob("*.safetensors"))
        if not found:
            raise ConversionError(
                f"no {INDEX} and no *.safetensors files in {self.dir} (only safetensors "
                "checkpoints are read: re-save others with save_pretrained(safe_serialization=True))"
            )
        return dict.fromkeys(found)

    def _read_header(self, file_name: str, expected: set[str] | None) -> None:
        path = self.dir / file_name
        try:
            with safe_open(path, "pt") as handle:
                stored = set(handle.keys())
                info = {name: handle.get_slice(name) for name in stored}
                shapes = {name: (tuple(s.get_shape()), s.get_dtype()) for name, s in info.items()}
        except (SafetensorError, OSError) as err:
            raise ConversionError(f"{path} is not a readable safetensors file ({err}); truncated or corrupt?") from None
        if expected is not None and expected - stored:
            raise ConversionError(
                f"{self.dir / INDEX} places tensors in {file_name} that it does not hold:\n"
                + listing(sorted(expected - stored))
            )
        for name in sorted(expected if expected is not None else stored):
            published = self.canonical(name)
            if published in self.file:
                raise ConversionError(f"{published} is stored twice: in {self.file[published]} and {file_name}")
            self.file[published], self.stored[published] = file_name, name
            self.shape[published], self.dtype[published] = shapes[name]

    @property
    def names(self) -> set[str]:
        return set(self.file)

    def where(self, name: str) -> Path:
        return self.dir / self.file[name]

    def read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, stop) of ``name``: a view of the open file's pages; copy it
        before ``release``."""
        if name in self._stored_rows:
            assert self.reshape is not None
            if self._cut is None or self._cut[0] != name:
                self._cut = (name, self.reshape.tensor(name, self._read(name, 0, 0, self._stored_rows[name])))
            cut = self._cut[1]
            return cut[start:stop] if dim == 0 else cut[:, start:stop]
        return self._read(name, dim, start, stop)

    def _read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        file_name = self.file[name]
        if self._open is None or self._open[0] != file_name:
            self.release()
            self._open = (file_name, safe_open(self.dir / file_name, "pt"))
        sliced = self._open[1].get_slice(self.stored[name])
        if name in self.parts:  # expert e's part j of the stored [E, in, k*out] (transposed) or [E, k*out, in]
            e, j, in_memory = self.parts[name]
            width = self.shape[name][0]
            rows = slice(j * width + start, j * width + stop) if dim == 0 else slice(j * width, (j + 1) * width)
            columns = slice(None) if dim == 0 else slice(start, stop)
            view = sliced[e, rows, columns] if in_memory else sliced[e, columns, rows].T
            prefault(view)
            return view
        view = sliced[start:stop] if dim == 0 else sliced[:, start:stop]
        prefault(view)
        return view

    def release(self) -> None:
        """Close the open file, giving its mapped pages back."""
        if self._open is not None:
            self._open[1].__exit__(None, None, None)
            self._open = None
        self._cut = None
