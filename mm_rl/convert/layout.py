"""MindSpeed-MM's Megatron checkpoint layout on disk, and directories that appear complete or not at all.

```
root/latest_checkpointed_iteration.txt      "release" (converted) or the step number (training), no newline
root/release | iter_{step:07d}/mp_rank_{tp:02d}[_{pp:03d} when PP > 1][_{ep:03d} when EP > 1]/model_optim_rng.pt
    torch.save({"model": {name: tensor}, "checkpoint_version": 3.0})   (training adds optimizer, rng, args...)
```
A directory is built under a hidden temporary name beside its target, flushed to disk and renamed into place
when complete; the latest file is written last, atomically, so a reader never sees a half-written checkpoint as
the latest one, not even after a crash.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from mm_rl.convert.errors import ConversionError, listing
from mm_rl.files import fsync_tree, replace_dir, torch_write_error, write_atomic

LATEST = "latest_checkpointed_iteration.txt"
COMPLETE = "complete"  # the trainer's marker, written last into an iteration: the layout and every file's size
ITER_RE = re.compile(r"iter_(\d{7})")
RELEASE = "release"
RANK_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
Iteration = int | str


# -------------------------------------------------------------------------------------------- complete
# The trainer's checkpoints (mm_rl.checkpoint) and mg2hf both ask which iterations are complete, so the answer
# lives here, with the layout, below both.
def iteration_steps(root: Path) -> list[int]:
    """The steps of every ``iter_NNNNNNN`` directory in ``root``, complete or not, oldest first."""
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := ITER_RE.fullmatch(p.name)))


def complete_steps(root: Path) -> list[int]:
    """The steps of every complete ``iter_NNNNNNN`` directory in ``root``, oldest first."""
    return [s for s in iteration_steps(root) if incomplete_reason(root / iteration_name(s)) is None]


def incomplete_reason(directory: Path) -> str | None:
    """Why an iteration directory cannot be loaded, or None. It is complete when its marker exists and every file
    it lists has the recorded size (the marker is written after the files are flushed, so a size match means the
    whole file reached the disk)."""
    if not directory.is_dir():
        return f"{directory} does not exist"
    marker_path = directory / COMPLETE
    if not marker_path.exists():
        return f"{directory} has no '{COMPLETE}' marker (a save that did not finish, or not written by mm_rl)"
    try:
        marker = json.loads(marker_path.read_text())
        files = marker["files"]
        _ = marker["tp"], marker["pp"]
    except OSError as err:
        return f"{marker_path} cannot be read ({describe_os_error(err)})"
    except (ValueError, KeyError, TypeError):
        return f"{marker_path} is damaged (not the JSON a save writes)"
    for name, size in files.items():
        path = directory / name
        if not path.is_file():
            top = directory / Path(name).parts[0]
            return f"{top} is missing" if not top.exists() else f"{path} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{path} is {'truncated' if actual < size else 'altered'} ({actual} bytes, its marker says {size})"
    return None


def describe_os_error(err: OSError, path: str | os.PathLike[str] | None = None) -> str:
    """ "no space left on device: <path>": the errno's meaning and the path (``path`` when the error names none:
    a full disk fails a write, not an open), as a user reads it, instead of a traceback; with the space needed and
    free when the error knows them (``mm_rl.files.NoSpace``)."""
    what = os.strerror(err.errno).lower() if err.errno else (str(err) or type(err).__name__)
    where = err.filename if err.filename is not None else path
    text = f"{what}: {where}" if where is not None else what
    detail = getattr(err, "detail", None)
    return f"{text} ({detail})" if detail else text


# ----------------------------------------------------------------------------------------------- names
def iteration_name(iteration: Iteration) -> str:
    """``release`` or ``iter_0000123``."""
    if iteration == RELEASE:
        return RELEASE
    if isinstance(iteration, str) and iteration.isdigit():
        iteration = int(iteration)
    if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
        raise ConversionError(f"iteration {iteration!r} is neither 'release' nor a step number")
    return f"iter_{iteration:07d}"


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """megatron's (and MindSpeed-MM's) rank directory: an EP rank holds its experts and a copy of the rest."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + (f"_{ep_rank:03d}" if ep > 1 else "")


def rank_file(iteration_dir: Path, tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> Path:
    return iteration_dir / rank_dir_name(tp_rank, pp_rank, pp, ep_rank, ep) / RANK_FILE


# -------------------------------------------------------------------------------------------- latest
def read_latest(root: Path) -> Iteration | None:
    """The iteration ``root``'s latest file names; None when there is no latest file."""
    path = root / LATEST
    if not path.is_file():
        return None
    text = path.read_text().strip()
    if text == RELEASE:
        return RELEASE
    if text.isdigit():
        return int(text)
    raise ConversionError(f"{path} holds {text!r}, neither 'release' nor a step number")


def write_latest(root: Path, iteration: Iteration) -> None:
    """Write the latest file atomically (a temporary file renamed over it) and durably."""
    write_atomic(root / LATEST, RELEASE if iteration == RELEASE else str(int(iteration)))


def remove_latest_if(root: Path, iteration: Iteration) -> None:
    """Drop the latest file before replacing the iteration it names, so a crash cannot leave it pointing at a
    half-replaced directory."""
    with contextlib.suppress(ConversionError):
        if read_latest(root) == iteration:
            (root / LATEST).unlink()


def resolve_iteration(root: Path, iteration: Iteration | None) -> Path:
    """The directory of ``iteration`` (None: the one the latest file names), with errors that say what exists."""
    if not root.is_dir():
        raise ConversionError(f"checkpoint directory {root} does not exist")
    available = sorted(p.name for p in root.iterdir() if p.is_dir() and re.fullmatch(r"release|iter_\d{7}", p.name))
    if iteration is None:
        iteration = read_latest(root)
        if iteration is None:
            raise ConversionError(
                f"{root / LATEST} is missing: {root} is not a Megatron checkpoint, or its save or conversion was "
                f"interrupted before completing (iterations present: {available or 'none'}); convert again, or "
                "pass an iteration explicitly if you know one is complete"
            )
    path = root / iteration_name(iteration)
    if not path.is_dir():
        raise ConversionError(f"{path} does not exist (iterations present in {root}: {available or 'none'})")
    return path


def check_rank_dirs(iteration_dir: Path, tp: int, pp: int, ep: int = 1) -> None:
    """The ``mp_rank_*`` directories must be exactly those of TP x PP (x EP); say what the checkpoint has
    otherwise."""
    found = {p.name for p in iteration_dir.iterdir() if p.is_dir() and p.name.startswith("mp_rank_")}
    expected = {rank_dir_name(t, p, pp, e, ep) for t in range(tp) for p in range(pp) for e in range(ep)}
    if found == expected:
        return
    ranks = [tuple(int(x) for x in re.findall(r"\d+", name)) for name in found]
    shape = f"TP={1 + max(r[0] for r in ranks)} x PP={1 + max((r[1] if len(r) > 1 else 0) for r in ranks)}"
    lines = [f"missing {n}" for n in sorted(expected - found)] + [f"unexpected {n}" for n in sorted(found - expected)]
    raise ConversionError(
        f"{iteration_dir} holds rank directories of {shape if ranks else 'nothing'}, the parallel "
        f"config gives TP={tp} x PP={pp}{f' x EP={ep}' if ep > 1 else ''}:\n" + listing(lines)
    )


# ------------------------------------------------------------------------------------------ rank files
class _Inert:
    """Stands in for any non-tensor object in a rank file (args, RNG states): it is never constructed for
    real, so loading cannot run code, and conversion only needs the "model" entry anyway."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __setstate__(self, state: object) -> None:
        pass


def load_rank_data(path: Path) -> Mapping[str, Any]:
    """A rank file's whole dict, memory-mapped (pages are read only when a tensor is used); its non-tensor entries
    (optimizer, RNG, args) are never constructed. It must hold a "model" state dict."""
    if not path.is_file():
        raise ConversionError(f"{path} is missing (an incomplete checkpoint, or another TP/PP layout?)")
    try:
        foreign = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        with torch.serialization.safe_globals([(_Inert, name) for name in foreign]):
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # torch raises several types for truncated or foreign files
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConversionError(
            f"{path} cannot be read as a torch checkpoint ({first}); half-written or corrupt?"
        ) from None
    if not isinstance(data, Mapping) or not isinstance(data.get("model"), Mapping):
        keys = list(data) if isinstance(data, Mapping) else type(data).__name__
        raise ConversionError(
            f"{path} has no 'model' state dict (it holds {keys}); virtual-pipeline checkpoints "
            "(model0, model1, ...) are not supported"
        )
    return data


def load_model_state(path: Path) -> Mapping[str, torch.Tensor]:
    """The "model" dict of a rank file (see :func:`load_rank_data`); a LoRA checkpoint's: its base's with the
    adapters merged (:func:`lora_merged_state`)."""
    data = load_rank_data(path)
    if isinstance(data.get("lora"), Mapping):
        return lora_merged_state(path, data)
    return dict(data["model"])


def lora_meta(path: Path) -> dict[str, Any] | None:
    """A LoRA checkpoint rank file's ``lora`` entry (its base, rank, alpha, scale); None for a whole model."""
    lora = load_rank_data(path).get("lora")
    return dict(lora) if isinstance(lora, Mapping) else None


def lora_merged_state(path: Path, data: Mapping[str, Any]) -> Mapping[str, torch.Tensor]:
    """A LoRA checkpoint's rank file holds only adapters: the model is the same rank file of the base iteration
    it names (``lora.base``, the job's converted checkpoint) with each adapter merged into its weight as read."""
    from mm_rl.models.lora import MergedState

    base = Path(data["lora"]["base"]) / path.parent.name / path.name
    if not base.is_file():
        raise ConversionError(
            f"{path} holds LoRA adapters of {base}, which is missing: convert where the job's converted base "
            "checkpoint is (or put it back at that path)"
        )
    return MergedState({**load_model_state(base), **data["model"]}, float(data["lora"]["scale"]))


def save_model_state(path: Path, state: Mapping[str, torch.Tensor], zip_crc32: bool = False) -> None:
    """``torch.save`` in MindSpeed-MM's format.

    Without ``zip_crc32`` the zip records carry no checksum: torch.load never verifies it (torch is built with
    miniz's reader CRC checks disabled, at least since 1.10), and computing it costs about a second per GB;
    only generic zip tools (``unzip -t``, Python's ``zipfile``) would complain."""
    path.parent.mkdir(parents=True, exist_ok=True)
    get, set_ = (getattr(torch.serialization, n, None) for n in ("get_crc32_options", "set_crc32_options"))
    before = get() if get and set_ else None
    if set_ and before is not None:
        set_(zip_crc32)
    try:
        with torch_write_error(path):
            torch.save({"model": dict(state), "checkpoint_version": CHECKPOINT_VERSION}, path)
    finally:
        if set_ and before is not None:
            set_(before)


# ------------------------------------------------------------------------------------ atomic directories
@contextlib.contextmanager
def staged_dir(target: Path, before_swap: Callable[[], None] | None = None) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``target``; on success it replaces ``target`` by rename (after
    ``before_swap``), on error it is removed and ``target`` is left as it was. Leftovers of killed runs on this
    host are removed first."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_leftovers(target)
    staging = Path(tempfile.mkdtemp(prefix=_leftover_prefix(target, "partial"), dir=target.parent))
    try:
        yield staging
        staging.chmod(0o755)
        fsync_tree(staging)
        if before_swap is not None:
            before_swap()
        replace_dir(staging, target, prefix=_leftover_prefix(target, "old"))
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _leftover_prefix(target: Path, kind: str) -> str:
    """``.{name}.{kind}.{host}.{pid}.``: the host and pid tell ``_remove_dead_leftovers`` whose leftover it is."""
    return f".{target.name}.{kind}.{socket.gethostname()}.{os.getpid()}."


def _remove_dead_leftovers(target: Path) -> None:
    host = re.escape(socket.gethostname())
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(partial|old)\.{host}\.(\d+)\..+")
    for path in target.parent.iterdir():
        match = pattern.fullmatch(path.name)
        if match and not _alive(int(match.group(2))):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
