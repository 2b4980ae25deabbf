"""Training checkpoints, written by the actor ranks and committed by the trainer: MindSpeed-MM / Megatron layout,
published atomically, pruned, resumable.

```
save_dir/latest_checkpointed_iteration.txt     the step number, rewritten atomically after the directory exists
save_dir/iter_{step:07d}/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt   one per rank (see mm_rl.convert.layout)
save_dir/iter_{step:07d}/trainer_state.pt      sampler position, metrics history, KL controller, ...
save_dir/iter_{step:07d}/complete              JSON marker written last: the layout and every file's size
```
An iteration is built in ``save_dir/.iter_{step:07d}.tmp-<uuid>`` (every file fsync'd), closed by the marker,
renamed into place, and only then named by the latest file; a crash at any point leaves the previous
checkpoint as the latest loadable one, and a failed save (a full disk) removes its temporary directory at once.
Multi-process trainers call ``stage`` (one rank, inside ``saving``; share the path), ``write_rank`` (every rank,
its own file), then ``commit`` (one rank, after a barrier); ``save`` is the same in one process.

Resuming never silently starts over: when iterations exist but none is complete, ``resolve_resume`` refuses
(``CheckpointRefused``: what is wrong and the user's choices) rather than let a fresh run overwrite them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from mm_rl.convert.errors import ConversionError
from mm_rl.convert.layout import (
    CHECKPOINT_VERSION,
    COMPLETE,
    ITER_RE,
    LATEST,
    RANK_FILE,
    complete_steps,
    describe_os_error,
    incomplete_reason,
    iteration_name,
    iteration_steps,
    rank_file,
    read_latest,
    write_latest,
)
from mm_rl.files import (
    fsync_path,
    fsync_tree,
    os_error_in,
    remove_dir_atomically,
    replace_dir,
    require_space,
    save_torch_synced,
    unique_sibling,
)

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.pt"
OPTIM_KEYS = ("optimizer", "opt_param_scheduler")
RNG_KEYS = ("rng_state",)
_STAGING_RE = re.compile(r"\.iter_(\d{7})\.tmp-[0-9a-f]+")
_RANK_DIR_RE = re.compile(r"mp_rank_(\d{2})((?:_\d{3}){0,2})")  # TP, then PP and / or EP ranks (layout.rank_dir_name)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or resumed from; the message names the path and what is wrong."""


class CheckpointRefused(CheckpointError):
    """``resume_mode`` names no checkpoint that can be loaded, and starting over instead would overwrite the run's
    checkpoints: the user chooses. ``rule`` says what is wrong (paths and reasons), ``fix`` lists the choices, so
    callers can report it in the job config's (key, value, rule, fix) form."""

    def __init__(self, resume_mode: str, rule: str, fix: str) -> None:
        super().__init__(f"resume_mode {resume_mode!r}: {rule}. Fix: {fix}")
        self.resume_mode, self.rule, self.fix = resume_mode, rule, fix


class CheckpointManager:
    """Saves, finds, loads and prunes the trainer's checkpoints under ``save_dir``.

    ``keep_last``: how many complete iterations to keep after each save (0 keeps all)."""

    def __init__(self, save_dir: str | os.PathLike[str], keep_last: int) -> None:
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0, got {keep_last}")
        self.save_dir = Path(save_dir)
        self.keep_last = keep_last
        self._staging: dict[int, Path] = {}

    # ------------------------------------------------------------------------------------------- saving
    def save(
        self, step: int, rank_states: Mapping[tuple[int, int], Mapping[str, Any]], trainer_state: Mapping[str, Any]
    ) -> Path:
        """Write every rank's state and the trainer state as iteration ``step``; returns its directory.

        On an error nothing is published (see ``saving``): the previous checkpoint stays the latest."""
        if not rank_states:
            raise CheckpointError(f"save of step {step} got no rank states")
        pp_size = 1 + max(pp for _, pp in rank_states)
        with self.saving(step) as staging:
            for (tp, pp), state in sorted(rank_states.items()):
                self.write_rank(staging, tp, pp, state, pp_size=pp_size)
            self.write_trainer_state(staging, trainer_state)
            return self.commit(staging, step, expected=set(rank_states))

    @contextlib.contextmanager
    def saving(self, step: int) -> Iterator[Path]:
        """``stage(step)`` for a block that writes and commits the iteration. Should the block fail, the temporary
        directory is removed at once (its partial files may be what fills the disk) and the latest file still
        names the previous checkpoint; an OSError (disk full, read-only, no permission) becomes a
        ``CheckpointError`` that names the path and the errno's meaning, so the user reads no traceback."""
        staging = self.stage(step)
        try:
            require_space(self.save_dir, self._size_of_latest() * 21 // 20, f"checkpoint step {step}")
            yield staging
        except BaseException as err:
            self._staging.pop(step, None)
            shutil.rmtree(staging, ignore_errors=True)
            disk = os_error_in(err)  # raised here, or by a rank (through its Ray error)
            if disk is not None:
                raise CheckpointError(
                    f"cannot save checkpoint step {step}: {describe_os_error(disk, staging)}; the "
                    f"unfinished save was removed, {self._latest_text()}"
                ) from err
            raise

    def _size_of_latest(self) -> int:
        """The bytes of the latest complete checkpoint, what the next save will write again (0: none yet)."""
        try:
            step = read_latest(self.save_dir)
        except ConversionError:
            return 0
        if not isinstance(step, int):
            return 0
        return sum(p.stat().st_size for p in (self.save_dir / iteration_name(step)).rglob("*") if p.is_file())

    def _latest_text(self) -> str:
        try:
            named = read_latest(self.save_dir)
        except ConversionError:
            named = None
        if not isinstance(named, int):
            return f"no checkpoint in {self.save_dir} is marked latest"
        return f"the latest checkpoint is step {named} ({self.save_dir / iteration_name(named)})"

    def stage(self, step: int) -> Path:
        """The temporary directory of ``step``'s save, created on the first call (later calls return it), so
        one rank can create it and hand the path to the others."""
        if step in self._staging and self._staging[step].is_dir():
            return self._staging[step]
        iteration_name(step)  # validates the step
        self.save_dir.mkdir(parents=True, exist_ok=True)
        staging = unique_sibling(self.save_dir / iteration_name(step), _staging_prefix(step))
        staging.mkdir()
        self._staging[step] = staging
        return staging

    def write_rank(
        self,
        staging: Path,
        tp: int,
        pp: int,
        state: Mapping[str, Any],
        *,
        pp_size: int = 1,
        ep_rank: int = 0,
        ep: int = 1,
    ) -> Path:
        """Write one rank's ``model_optim_rng.pt`` (``state`` plus version and iteration), flushed to disk.

        ``pp_size`` (the pipeline size) and ``ep`` (expert parallelism) decide the file name: ``mp_rank_TT``, with
        ``_PPP`` when PP > 1 and ``_EEE`` when EP > 1 (each EP rank holds its experts and a copy of the rest)."""
        if not 0 <= pp < pp_size:
            raise CheckpointError(f"pp rank {pp} is outside pipeline size {pp_size}")
        path = rank_file(staging, tp, pp, pp_size, ep_rank, ep)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {**state, "checkpoint_version": CHECKPOINT_VERSION, "iteration": _staging_step(staging)}
        with _naming(path):
            save_torch_synced(payload, path)
        return path

    def write_trainer_state(self, staging: Path, trainer_state: Mapping[str, Any]) -> Path:
        """Write ``trainer_state.pt`` (whatever the trainer needs to resume: sampler, metrics, KL, ...)."""
        path = staging / TRAINER_STATE
        with _naming(path):
            save_torch_synced(dict(trainer_state), path)
        return path

    def commit(self, staging: Path, step: int, expected: set[tuple[int, int]] | None = None, ep: int = 1) -> Path:
        """Close ``staging`` with the marker, rename it to ``iter_NNNNNNN``, then point the latest file at it, then
        prune. ``expected`` (the (tp, pp) ranks) is checked when given; the ranks found must form a full grid (of
        ``ep`` EP ranks too: the file names alone cannot tell a PP rank from an EP rank)."""
        target = self.save_dir / iteration_name(step)
        self._write_marker(staging, step, expected, ep)
        fsync_tree(staging)
        # Re-saving a step: the latest file may name it, so it must never be half-replaced; the old tree is
        # renamed to a staging-like name that cleanup_stale removes should a crash leave it.
        replace_dir(staging, target, prefix=_staging_prefix(step))
        fsync_path(self.save_dir)
        self._staging.pop(step, None)
        write_latest(self.save_dir, step)
        self.prune(keep=step)
        return target

    def _write_marker(self, staging: Path, step: int, expected: set[tuple[int, int]] | None, ep: int = 1) -> None:
        """The marker is the last file written: its presence means every file it lists was flushed whole."""
        ranks = _rank_dirs(staging, ep)
        if expected is not None and {r[:2] for r in ranks.values()} != expected:
            raise CheckpointError(f"{staging} holds ranks {sorted(ranks.values())}, expected {sorted(expected)}")
        tp_size, pp_size = _grid_shape(staging, ranks, ep)
        fsync_tree(staging)  # files written by others (megatron's distrib_optim.pt) are flushed before the marker
        files = {
            path.relative_to(staging).as_posix(): path.stat().st_size
            for path in sorted(staging.rglob("*"))
            if path.is_file() and path.name != COMPLETE
        }
        marker = {"step": step, "tp": tp_size, "pp": pp_size, "ep": ep, "files": files}
        path = staging / COMPLETE
        with _naming(path), open(path, "w") as f:
            json.dump(marker, f)
            f.flush()
            os.fsync(f.fileno())

    # ------------------------------------------------------------------------------------------ pruning
    def prune(self, keep: int | None = None) -> list[int]:
        """Delete all but the newest ``keep_last`` complete iterations (never ``keep``); returns the deleted
        steps. A directory is renamed away before its removal so that no half-deleted iteration remains."""
        if self.keep_last == 0:
            return []
        doomed = [s for s in self.complete_steps()[: -self.keep_last] if s != keep]
        for step in doomed:
            remove_dir_atomically(self.save_dir / iteration_name(step), prefix=_staging_prefix(step))
        return doomed

    def cleanup_stale(self) -> list[Path]:
        """Remove temporary directories (and latest-file temporaries) left by killed saves or prunes, except the
        ones this manager is writing.
        Call it on one rank at startup, before any rank saves."""
        if not self.save_dir.is_dir():
            return []
        mine = set(self._staging.values())
        stale = [p for p in self.save_dir.iterdir() if _STAGING_RE.fullmatch(p.name) and p not in mine]
        stale += [p for p in self.save_dir.iterdir() if p.name.startswith(f".{LATEST}.") and p.is_file()]
        for path in stale:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        return stale

    # ----------------------------------------------------------------------------------------- finding
    def complete_steps(self) -> list[int]:
        """The steps of every complete ``iter_NNNNNNN`` directory, oldest first."""
        return complete_steps(self.save_dir)

    def _iteration_steps(self) -> list[int]:
        """The steps of every ``iter_NNNNNNN`` directory, complete or not, oldest first."""
        return iteration_steps(self.save_dir)

    def incomplete_reason(self, step: int) -> str | None:
        """Why iteration ``step`` cannot be loaded, or None when it is complete."""
        return incomplete_reason(self.save_dir / iteration_name(step))

    def latest(self) -> int | None:
        """The step ``resume_mode: auto`` resumes from: the one the latest file names when it is complete;
        otherwise the newest complete iteration, with a warning naming every newer one skipped and why; None when
        nothing was saved. Iterations that exist while none is complete are refused (``CheckpointRefused``):
        starting over would overwrite them."""
        return self.resolve_resume("auto")

    def _warn(self, step: int | None, notes: list[str]) -> int | None:
        for note in notes:
            logger.warning(
                "%s; falling back to %s, the newest complete checkpoint in %s",
                note,
                iteration_name(step),
                self.save_dir,
            )
        return step

    def _auto_resume(self) -> tuple[int | None, list[str]]:
        """(step, one note for each thing passed over on the way to it), or the refusal."""
        try:
            named, problem = read_latest(self.save_dir), None
        except ConversionError as err:
            named, problem = None, f"the latest file: {err}"
        else:
            problem = None if named is None else self._latest_problem(named)
        if named is not None and problem is None:
            return int(named), []
        complete = self.complete_steps()
        newest = complete[-1] if complete else None
        passed = [problem] if problem else []
        passed += [
            f"checkpoint step {s}: {self.incomplete_reason(s)}"
            for s in self._iteration_steps()
            if s != named and s > (-1 if newest is None else newest) and s not in complete
        ]
        if newest is None and passed:
            raise CheckpointRefused(
                "auto",
                f"{self.save_dir} holds no complete checkpoint to resume from: " + "; ".join(passed),
                self._choices(),
            )
        notes = [f"skipping {why}" for why in passed]
        if named is None and newest is not None and problem is None:
            notes.insert(0, f"{self.save_dir / LATEST} is missing")
        return newest, notes

    def _latest_problem(self, named: int | str) -> str | None:
        if not isinstance(named, int):
            return f"the latest file: {self.save_dir / LATEST} names {named!r}, not a training step"
        reason = self.incomplete_reason(named)
        return None if reason is None else f"checkpoint step {named} (the latest file names it): {reason}"

    def _choices(self) -> str:
        """What a user can set ``resume_mode`` to instead, naming the complete iterations (newest first)."""
        complete = [str(self.save_dir / iteration_name(s)) for s in reversed(self.complete_steps())]
        shown = ", ".join(complete[:3]) + (f" and {len(complete) - 3} older" if len(complete) > 3 else "")
        return (
            "set it to 'disable' to start over from step 0 (metrics are cut back and the checkpoints replaced), "
            "or to the path of a complete iter_NNNNNNN directory to resume from it ("
            + (f"complete: {shown})" if complete else f"none in {self.save_dir} is complete)")
        )

    def resolve_resume(self, resume_mode: str) -> int | None:
        """The step to resume from: "auto" (see ``latest``), "disable" (None), or the path of an ``iter_NNNNNNN``
        directory inside ``save_dir`` that must be complete (else ``CheckpointRefused``)."""
        return self._warn(*self.resume_point(resume_mode))

    def resume_point(self, resume_mode: str) -> tuple[int | None, list[str]]:
        """``resolve_resume`` without logging: the step and a note on each newer checkpoint passed over."""
        if resume_mode == "auto":
            return self._auto_resume()
        if resume_mode == "disable":
            return None, []
        path = Path(resume_mode)
        match = ITER_RE.fullmatch(path.name)
        if match is None:
            raise CheckpointRefused(
                resume_mode, "it is neither 'auto', 'disable' nor an iter_NNNNNNN checkpoint directory", self._choices()
            )
        if path.parent.resolve() != self.save_dir.resolve():
            raise CheckpointRefused(
                resume_mode,
                f"checkpoint {path} is not inside the save directory {self.save_dir}",
                f"set save to {path.parent}, or {self._choices()}",
            )
        reason = incomplete_reason(path)
        if reason is not None:
            raise CheckpointRefused(resume_mode, f"{path} is not a complete checkpoint: {reason}", self._choices())
        return int(match.group(1)), []

    # ----------------------------------------------------------------------------------------- loading
    def load(
        self, step: int, tp: int, pp: int, load_optim: bool = True, load_rng: bool = True, ep_rank: int = 0
    ) -> dict[str, Any]:
        """Rank (tp, pp, ep_rank)'s state of iteration ``step``, without optimizer / RNG entries when not wanted
        (Megatron's --no-load-optim / --no-load-rng: e.g. resuming with another optimizer or seed)."""
        marker = self._complete_marker(step)
        ep = int(marker.get("ep", 1))
        path = rank_file(self.save_dir / iteration_name(step), tp, pp, marker["pp"], ep_rank, ep)
        if not (tp < marker["tp"] and pp < marker["pp"] and ep_rank < ep):
            raise CheckpointError(
                f"{path}: rank (tp={tp}, pp={pp}, ep={ep_rank}) is outside the checkpoint's "
                f"TP={marker['tp']} x PP={marker['pp']} x EP={ep}"
            )
        state = _load(path)
        dropped = (OPTIM_KEYS if not load_optim else ()) + (RNG_KEYS if not load_rng else ())
        return {k: v for k, v in state.items() if k not in dropped}

    def load_trainer_state(self, step: int) -> dict[str, Any]:
        """The ``trainer_state`` passed to ``save`` for ``step``."""
        self._complete_marker(step)
        path = self.save_dir / iteration_name(step) / TRAINER_STATE
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: that checkpoint was saved without a trainer state")
        return _load(path)

    def grid(self, step: int) -> tuple[int, int, int]:
        """The (TP, PP, EP) iteration ``step`` was saved with (from its marker)."""
        marker = self._complete_marker(step)
        return int(marker["tp"]), int(marker["pp"]), int(marker.get("ep", 1))

    def _complete_marker(self, step: int) -> dict[str, Any]:
        directory = self.save_dir / iteration_name(step)
        reason = incomplete_reason(directory)
        if reason is not None:
            raise CheckpointError(f"cannot load step {step}: {reason}")
        return json.loads((directory / COMPLETE).read_text())


# ------------------------------------------------------------------------------------------------ helpers
@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """An OSError raised inside names ``path`` when the failing call did not."""
    try:
        yield
    except OSError as err:
        if err.filename is None:
            err.filename = str(path)
        raise


def _rank_dirs(staging: Path, ep: int = 1) -> dict[str, tuple[int, int, int]]:
    """``mp_rank_*`` directory name -> (tp, pp, ep rank) for every rank file in ``staging`` (with ``ep`` > 1 the
    last number of a name is its EP rank)."""
    ranks: dict[str, tuple[int, int, int]] = {}
    for path in staging.iterdir():
        match = _RANK_DIR_RE.fullmatch(path.name)
        if match and (path / RANK_FILE).is_file():
            rest = [int(n) for n in match.group(2).split("_")[1:]]
            expert = rest.pop() if ep > 1 and rest else 0
            ranks[path.name] = (int(match.group(1)), rest[0] if rest else 0, expert)
    return ranks


def _grid_shape(staging: Path, ranks: dict[str, tuple[int, int, int]], ep: int = 1) -> tuple[int, int]:
    """(TP, PP) of the rank files, which must be the full grid (with ``ep`` EP ranks): a missing rank means a rank
    did not finish."""
    if not ranks:
        raise CheckpointError(f"{staging} holds no rank files")
    tp_size = 1 + max(t for t, _, _ in ranks.values())
    pp_size = 1 + max(p for _, p, _ in ranks.values())
    staged = {name.count("_") - 2 - (ep > 1) > 0 for name in ranks}  # whether a name carries a stage
    if staged == {True} and pp_size == 1:
        raise CheckpointError(f"{staging} lacks rank files of pipeline stages after 0 (its names carry a stage)")
    if len(staged) > 1:
        raise CheckpointError(f"{staging} mixes rank directories with and without a pipeline stage")
    grid = {(t, p, e) for t in range(tp_size) for p in range(pp_size) for e in range(ep)}
    missing = grid - set(ranks.values())
    if missing:
        what = "(tp, pp, ep)" if ep > 1 else "(tp, pp)"
        raise CheckpointError(f"{staging} lacks rank files of {what} {sorted(m if ep > 1 else m[:2] for m in missing)}")
    return tp_size, pp_size


def _staging_prefix(step: int) -> str:
    """``.iter_NNNNNNN.tmp-``: staging directories and trees being removed share it, so that ``cleanup_stale``
    (``_STAGING_RE``: the prefix plus hex) finds every leftover of a killed save or prune."""
    return f".{iteration_name(step)}.tmp-"


def _staging_step(staging: Path) -> int:
    match = _STAGING_RE.fullmatch(staging.name)
    if match is None:
        raise CheckpointError(f"{staging} is not a staging directory made by CheckpointManager.stage")
    return int(match.group(1))


def _load(path: Path) -> dict[str, Any]:
    """Full unpickling: these are the trainer's own files, and optimizer / RNG states hold numpy and Python
    objects that ``weights_only`` refuses."""
    return torch.load(path, map_location="cpu", weights_only=False)
