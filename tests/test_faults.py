"""Run-time faults are refused or reported plainly and never lose work: a checkpoint directory whose only
iteration is incomplete is refused (not overwritten by a fresh run), a fresh start cuts the metrics and TensorBoard
history back to nothing and a resume to its step, a full or read-only disk during a save is named without a
traceback (the previous checkpoint stays latest, the unfinished save is removed), mg2hf on an incomplete latest
iteration names the complete one to ask for, and ``train`` advises a rerun only where one can help.

Trainer-level cases drive the real GRPOTrainer over the fake roles of test_trainer_loop (no Ray, no model)."""

from __future__ import annotations

import errno
import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_checkpoint import states, trainer_state
from test_trainer_loop import FakePrompts, FakeRoles, _job, _trainer

import mm_rl.job.run as job_module
from mm_rl.checkpoint import CheckpointError, CheckpointManager, CheckpointRefused
from mm_rl.config.loader import ConfigError
from mm_rl.convert.errors import ConversionError
from mm_rl.job.run import RERUN, failure_message, resume
from mm_rl.job.validate import validate
from mm_rl.trainer.grpo import TrainingStopped
from mm_rl.trainer.metrics import METRICS_FILE, MetricsLogger, read_metrics, rewind
from mm_rl.workers.group import WorkerError
from mm_rl_cli import main as cli

RESUME_KEY = "backend_config.megatron_training.resume_mode"


def rewards(seed, uid, k):  # the fake roles' reward: the response index
    return float(k)


def save_dir(job) -> Path:
    return Path(job.backend_config.megatron_training.save)


def rank_file(directory: Path, step: int, rank: str = "mp_rank_00") -> Path:
    return directory / f"iter_{step:07d}" / rank / "model_optim_rng.pt"


# ---------------------------------------------------------------------------- 1. a corrupt only checkpoint
def _truncate(directory: Path, step: int) -> str:
    path = rank_file(directory, step)
    path.write_bytes(path.read_bytes()[:-10])
    return f"{path} is truncated"


def _drop_marker(directory: Path, step: int) -> str:
    (directory / f"iter_{step:07d}" / "complete").unlink()
    return f"{directory / f'iter_{step:07d}'} has no 'complete' marker"


def _damage_marker(directory: Path, step: int) -> str:
    (directory / f"iter_{step:07d}" / "complete").write_text("{not json")
    return "is damaged"


@pytest.mark.parametrize("damage", [_truncate, _drop_marker, _damage_marker])
def test_auto_refuses_a_save_dir_whose_only_checkpoint_is_incomplete(tmp_path, damage):
    """Today's behaviour was a warning and a fresh start that overwrote it; now the user chooses."""
    mgr = CheckpointManager(tmp_path, keep_last=0)
    mgr.save(3, states(3, tp=1), trainer_state(3))
    why = damage(tmp_path, 3)
    with pytest.raises(CheckpointRefused) as refused:
        mgr.resolve_resume("auto")
    message = str(refused.value)
    assert why in message and f"{tmp_path} holds no complete checkpoint" in message
    assert "'disable' to start over" in message and "iter_NNNNNNN directory" in message
    assert f"none in {tmp_path} is complete" in message


def test_the_refusal_comes_before_anything_starts_in_the_job_format(tmp_path):
    job = _job(tmp_path)
    mgr = CheckpointManager(save_dir(job), keep_last=0)
    mgr.save(3, states(3, tp=1), trainer_state(3))
    why = _truncate(save_dir(job), 3)
    (violation,) = [v for v in validate(job) if v.key == RESUME_KEY]  # `check`, and `train` before it starts
    assert violation.value == "auto" and why in violation.rule and "'disable'" in violation.fix
    disabled = _job(tmp_path, "--backend_config.megatron_training.resume_mode=disable")  # the user's choice
    assert not [v for v in validate(disabled) if v.key == RESUME_KEY]


def test_the_trainer_refuses_too_and_keeps_the_metrics(tmp_path):
    job = _job(tmp_path)
    CheckpointManager(save_dir(job), keep_last=0).save(3, states(3, tp=1), trainer_state(3))
    _truncate(save_dir(job), 3)
    (tmp_path / METRICS_FILE).write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    with pytest.raises(ConfigError, match=f"{RESUME_KEY} = 'auto': .* holds no complete checkpoint"):
        resume(_trainer(job, FakeRoles(2, rewards)), job)
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1, 2, 3]
    assert rank_file(save_dir(job), 3).is_file()


def test_a_corrupt_newest_checkpoint_is_skipped_by_name(tmp_path, caplog):
    """The good case: an earlier complete checkpoint exists, so auto resumes from it and says what it skipped."""
    mgr = CheckpointManager(tmp_path, keep_last=0)
    for step in (2, 3):
        mgr.save(step, states(step, tp=1), trainer_state(step))
    why = _truncate(tmp_path, 3)
    with caplog.at_level(logging.WARNING, logger="mm_rl.checkpoint"):
        assert mgr.resolve_resume("auto") == 2
    assert f"skipping checkpoint step 3 (the latest file names it): {why}" in caplog.text
    assert f"falling back to iter_0000002, the newest complete checkpoint in {tmp_path}" in caplog.text


def test_an_incomplete_resume_path_lists_the_complete_ones(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=0)
    for step in (1, 2, 3):
        mgr.save(step, states(step, tp=1), trainer_state(step))
    why = _truncate(tmp_path, 3)
    with pytest.raises(CheckpointRefused) as refused:
        mgr.resolve_resume(str(tmp_path / "iter_0000003"))
    assert why in refused.value.rule
    assert f"complete: {tmp_path / 'iter_0000002'}, {tmp_path / 'iter_0000001'})" in refused.value.fix
    assert mgr.resolve_resume(str(tmp_path / "iter_0000002")) == 2


# ------------------------------------------------------------------------- 2. a PP stage directory missing
def test_a_pp_checkpoint_missing_a_stage_dir_is_refused_by_name(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=0)
    mgr.save(4, states(4, tp=1, pp=2), trainer_state(4))
    assert mgr.resolve_resume("auto") == 4  # whole: it resumes
    stage = tmp_path / "iter_0000004" / "mp_rank_00_001"
    shutil.rmtree(stage)
    with pytest.raises(CheckpointRefused) as refused:
        mgr.resolve_resume("auto")
    assert f"{stage} is missing" in refused.value.rule and "'disable'" in refused.value.fix


# ------------------------------------------------------------------- 3. the history follows the checkpoint
def _log(out_dir: Path, steps) -> None:
    with MetricsLogger(out_dir) as sink:
        for step in steps:
            sink.log(step, {"reward/score": step / 10})
            sink._tb.add_text("note", f"step {step}", global_step=step)


def _events(out_dir: Path) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    return {
        "scalars": [e.step for e in events.Scalars("reward/score")] if events.Tags()["scalars"] else [],
        "text": [e.step for e in events.Tensors("note/text_summary")] if events.Tags()["tensors"] else [],
    }


def test_a_fresh_start_cuts_metrics_and_tensorboard_to_nothing(tmp_path):
    """Runs killed before their first checkpoint used to leave their steps behind: 5 copies of step 1."""
    _log(tmp_path, [1, 2])
    _log(tmp_path, [1])
    job = _job(
        tmp_path,
        "--backend_config.megatron_training.train_iters=1",
        "--backend_config.megatron_training.save_interval=100",
    )
    trainer = _trainer(job, FakeRoles(2, rewards))
    assert trainer.resume() is None
    assert read_metrics(tmp_path / METRICS_FILE) == [] and not list((tmp_path / "tensorboard").iterdir())
    trainer.fit()
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1]


def test_resume_disable_is_a_fresh_start_too(tmp_path):
    job = _job(
        tmp_path,
        "--backend_config.megatron_training.train_iters=2",
        "--backend_config.megatron_training.save_interval=1",
    )
    _trainer(job, FakeRoles(2, rewards)).fit()
    again = _trainer(_job(tmp_path, "--backend_config.megatron_training.resume_mode=disable"), FakeRoles(2, rewards))
    assert again.resume() is None and read_metrics(tmp_path / METRICS_FILE) == []


def test_a_resume_keeps_history_up_to_its_step_in_tensorboard_too(tmp_path):
    """TensorBoard does not replace a step logged twice, so the events past the checkpoint are dropped (every
    kind: scalars and text) and the rerun steps follow the kept ones."""
    _log(tmp_path, [1, 2, 3])
    _log(tmp_path, [4])  # a second event file, as a resumed run writes
    rewind(tmp_path, 2)
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1, 2]
    assert len(list((tmp_path / "tensorboard").iterdir())) == 1
    assert _events(tmp_path) == {"scalars": [1, 2], "text": [1, 2]}
    _log(tmp_path, [3])
    assert _events(tmp_path) == {"scalars": [1, 2, 3], "text": [1, 2, 3]}


def test_rewind_tolerates_a_torn_event_file(tmp_path):
    _log(tmp_path, [1, 2, 3])
    (events,) = (tmp_path / "tensorboard").iterdir()
    events.write_bytes(events.read_bytes()[:-5])  # killed mid-write: the last record is torn
    rewind(tmp_path, 5)
    assert _events(tmp_path)["scalars"] == [1, 2, 3]


# -------------------------------------------------------------------------- 4. disk full / read-only on save
def _failing_torch_save(code: int, after: int = 0):
    """torch.save that fails like the disk does: a full disk fails a write (no file name on the error), a
    read-only or forbidden one the open (with it); ``after`` saves succeed first."""
    real, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) <= after:
            return real(obj, f, *args, **kwargs)
        if code == errno.ENOSPC:
            raise OSError(code, "No space left on device")
        raise OSError(code, "whatever the OS says", getattr(f, "name", str(f)))

    return save


@pytest.mark.parametrize(
    "code, meaning",
    [
        (errno.ENOSPC, "no space left on device"),
        (errno.EROFS, "read-only file system"),
        (errno.EACCES, "permission denied"),
    ],
)
def test_a_disk_error_during_a_save_is_named_and_the_previous_checkpoint_stays(tmp_path, monkeypatch, code, meaning):
    mgr = CheckpointManager(tmp_path, keep_last=0)
    mgr.save(1, states(1), trainer_state(1))
    monkeypatch.setattr(torch, "save", _failing_torch_save(code, after=1))  # the second rank's file fails
    with pytest.raises(CheckpointError) as failed:
        mgr.save(2, states(2), trainer_state(2))
    message = str(failed.value)
    assert message.startswith(f"cannot save checkpoint step 2: {meaning}: {tmp_path}/.iter_0000002.tmp-")
    assert message.split(": ")[2].endswith(
        "/mp_rank_01/model_optim_rng.pt; the unfinished save was removed, the "
        f"latest checkpoint is step 1 ({tmp_path / 'iter_0000001'})"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert mgr.latest() == 1
    advice = failure_message(failed.value)
    assert advice.startswith(message) and "Traceback" not in advice
    assert advice.endswith("then run the same command again: it resumes from the last complete checkpoint")


def test_the_trainer_removes_a_failed_save_at_once(tmp_path):
    class FullDisk(FakeRoles):
        def save(self, staging):
            super().save(staging)
            if "iter_0000002" in staging.name:
                raise OSError(errno.ENOSPC, "No space left on device")

    job = _job(
        tmp_path,
        "--backend_config.megatron_training.train_iters=2",
        "--backend_config.megatron_training.save_interval=1",
    )
    with pytest.raises(
        CheckpointError,
        match="cannot save checkpoint step 2: no space left on device: .*the latest checkpoint is step 1",
    ):
        _trainer(job, FullDisk(2, rewards)).fit()
    assert sorted(p.name for p in save_dir(job).iterdir()) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


def test_train_prints_a_disk_error_without_a_traceback(tmp_path, monkeypatch, capsys):
    def full_disk_run(job, report=print):
        monkeypatch.setattr(torch, "save", _failing_torch_save(errno.ENOSPC))
        CheckpointManager(tmp_path, keep_last=0).save(1, states(1), trainer_state(1))

    monkeypatch.setattr(cli, "_validated_job", lambda path, overrides: SimpleNamespace())
    monkeypatch.setattr(job_module, "run_job", full_disk_run)
    assert cli.main(["train", "job.yaml"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot save checkpoint step 1: no space left on device: {tmp_path}/")
    assert "free space" in err and "Traceback" not in err


TORCH_FULL_DISK = "[enforce fail at inline_container.cc:603] . unexpected pos 4928 vs 4816"


def _torch_writer_failing(after: int = 0):
    """torch.save as torch's zip writer fails on a full disk: a RuntimeError with no errno."""
    real, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) <= after:
            return real(obj, f, *args, **kwargs)
        raise RuntimeError(TORCH_FULL_DISK)

    return save


def test_torchs_failed_write_on_a_full_disk_is_named_with_the_free_space(tmp_path, monkeypatch):
    from mm_rl import files

    mgr = CheckpointManager(tmp_path, keep_last=0)
    mgr.save(1, states(1), trainer_state(1))
    monkeypatch.setattr(torch, "save", _torch_writer_failing())
    monkeypatch.setattr(files, "free_bytes", lambda path: 1 << 20)  # what is left once the disk filled up
    monkeypatch.setattr(CheckpointManager, "_size_of_latest", lambda self: 0)  # (the space check is tested below)
    with pytest.raises(CheckpointError) as failed:
        mgr.save(2, states(2), trainer_state(2))
    message = str(failed.value)
    assert message.startswith(f"cannot save checkpoint step 2: no space left on device: {tmp_path}/.iter_0000002")
    assert "(0.0 GiB free)" in message and "the latest checkpoint is step 1" in message
    advice = failure_message(failed.value)
    assert "free space on that file system" in advice and "inline_container" not in advice
    monkeypatch.setattr(files, "free_bytes", lambda path: 100 << 30)  # not full: an I/O error, named as such
    with pytest.raises(CheckpointError, match="input/output error"):
        mgr.save(2, states(2), trainer_state(2))


def test_a_save_that_cannot_fit_is_refused_before_it_writes(tmp_path, monkeypatch):
    from mm_rl import files

    mgr = CheckpointManager(tmp_path, keep_last=0)
    mgr.save(1, states(1), trainer_state(1))
    size = sum(p.stat().st_size for p in (tmp_path / "iter_0000001").rglob("*") if p.is_file())
    monkeypatch.setattr(files, "free_bytes", lambda path: size // 2)
    writes = []
    monkeypatch.setattr(torch, "save", lambda *args, **kwargs: writes.append(args))
    with pytest.raises(CheckpointError) as failed:
        mgr.save(2, states(2), trainer_state(2))
    assert writes == []
    assert f"no space left on device: {tmp_path} (checkpoint step 2 needs about" in str(failed.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


def test_a_ranks_disk_error_is_found_through_its_ray_error():
    """Ray hands a rank's exception over as a copy without its errno (``cause`` holds the original)."""
    from mm_rl.files import NoSpace, os_error_in

    class RayTaskErrorLike(OSError):
        def __init__(self, cause):
            self.cause = cause  # as Ray's RayTaskError(OSError): OSError's errno is not set

    original = NoSpace(Path("/ckpt"), "1.0 GiB free")
    worker = WorkerError("actor rank 0 failed in save_checkpoint: NoSpace")
    worker.__cause__ = RayTaskErrorLike(original)
    assert os_error_in(worker) is original
    assert failure_message(worker).startswith("no space left on device: /ckpt (1.0 GiB free)")


def test_hf2mg_refuses_to_start_without_room_for_its_shards(tmp_path, monkeypatch):
    from test_convert import to_mg

    from mm_rl import files
    from mm_rl.demo.tiny import build_tiny_checkpoint

    hf = build_tiny_checkpoint(tmp_path / "hf", seed=0)
    monkeypatch.setattr(files, "free_bytes", lambda path: 1024)
    with pytest.raises(OSError) as failed:
        to_mg(hf, tmp_path / "mm", 1, [2], [4])
    assert failed.value.errno == errno.ENOSPC and not (tmp_path / "mm" / "release").exists()
    assert "hf2mg's Megatron shards needs about" in failure_message(failed.value)


# ---------------------------------------------------------------------- 5. mg2hf on an incomplete iteration
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A training checkpoint directory with complete iterations 3 and 5 of the tiny model (TP1, one stage)."""
    from test_convert import model_for, rank_state, to_mg

    from mm_rl.demo.tiny import build_tiny_checkpoint

    hf = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "hf", seed=0)
    model = rank_state(to_mg(hf, tmp_path_factory.mktemp("mm") / "mm", 1, [2], [4]), 0, 0, 1)["model"]
    ckpt = tmp_path_factory.mktemp("ckpt")
    mgr = CheckpointManager(ckpt, keep_last=0)
    for step in (3, 5):
        mgr.save(step, {(0, 0): {"model": model}}, {"step": step})
    return hf, model_for(hf, [2], [4]), ckpt


def _mg2hf(trained, tmp_path, ckpt, iteration=None):
    from test_convert import to_hf

    hf, model, _ = trained
    return to_hf(hf, ckpt, tmp_path / "out", 1, [2], [4], model=model, iteration=iteration)


def test_mg2hf_names_the_complete_earlier_iteration(trained, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained[2], ckpt)
    why = _truncate(ckpt, 5)
    with pytest.raises(ConversionError) as failed:
        _mg2hf(trained, tmp_path, ckpt)
    message = str(failed.value)
    assert message.startswith(f"iteration 5 is incomplete: {why} (") and message.endswith(
        f"; the newest complete earlier iteration is 3 ({ckpt / 'iter_0000003'}): convert it with --iteration 3"
    )
    assert (_mg2hf(trained, tmp_path, ckpt, iteration=3) / "config.json").is_file()


def test_mg2hf_says_when_no_iteration_is_complete(trained, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained[2], ckpt)
    shutil.rmtree(ckpt / "iter_0000003")
    _truncate(ckpt, 5)
    with pytest.raises(
        ConversionError, match=f"iteration 5 is incomplete: .*; no earlier iteration in {ckpt} is complete"
    ):
        _mg2hf(trained, tmp_path, ckpt)


def test_convert_cli_reports_it_without_a_traceback(trained, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained[2], ckpt)
    _drop_marker(ckpt, 5)
    hf = trained[0]
    assert (
        cli.main(
            [
                "convert",
                "mg2hf",
                "--cfg.load_dir",
                str(ckpt),
                "--cfg.save_hf_dir",
                str(tmp_path / "out"),
                "--hf_dir",
                str(hf),
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert err.startswith("error: iteration 5 is incomplete:") and "convert it with --iteration 3" in err
    assert "Traceback" not in err


# ---------------------------------------------------------------------------- 6. advice that fits the error
def test_a_rerun_is_advised_only_where_it_can_help(tmp_path):
    assert failure_message(WorkerError("actor rank 1 failed in train_mini_batch: process died")) == (
        f"actor rank 1 failed in train_mini_batch: process died\n{RERUN}"
    )
    stopped = failure_message(TrainingStopped("3 steps in a row had a NaN/inf loss; lower the lr"))
    assert "unchanged, a rerun repeats this" in stopped and RERUN not in stopped
    refused = CheckpointRefused("auto", "x holds no complete checkpoint", "set it to 'disable'")
    assert failure_message(refused) == str(refused)  # the fix is in the message; a rerun repeats it
    assert failure_message(ConversionError("iteration 5 is incomplete: ...")) == "iteration 5 is incomplete: ..."
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "metrics.jsonl"))
    assert failure_message(full).startswith(f"no space left on device: {tmp_path / 'metrics.jsonl'}\nfree space")
    assert failure_message(FileNotFoundError(errno.ENOENT, "gone", "x")) is None  # a bug: keep its traceback
    assert failure_message(RuntimeError("a bug")) is None
    assert failure_message(ConfigError([])) is None  # the CLI's own handler prints it


def test_train_keeps_the_traceback_of_a_bug(monkeypatch):
    def bug(job, report=print):
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "_validated_job", lambda path, overrides: SimpleNamespace())
    monkeypatch.setattr(job_module, "run_job", bug)
    with pytest.raises(KeyError):
        cli.main(["train", "job.yaml"])


def test_a_checkpoint_that_does_not_fit_the_data_is_a_config_error(tmp_path):
    """The sampler refuses a state from another seed or data set (its order would differ): the user chooses."""

    class OtherData(FakePrompts):
        def load_state_dict(self, state):
            raise ValueError("sampler state has num_items=8 but this run has 6; the prompt order would differ")

    job = _job(tmp_path, "--backend_config.megatron_training.train_iters=1")
    _trainer(job, FakeRoles(2, rewards)).fit()
    trainer = _trainer(job, FakeRoles(2, rewards))
    trainer.prompts = OtherData(2)
    with pytest.raises(ConfigError) as refused:
        resume(trainer, job)
    (violation,) = refused.value.violations
    assert violation.key == RESUME_KEY and "num_items=8 but this run has 6" in violation.rule
    assert "'disable'" in violation.fix
    assert json.loads((tmp_path / METRICS_FILE).read_text().splitlines()[0])["step"] == 1  # nothing cut
