"""Metrics: the jsonl record survives crashes and resumes, TensorBoard gets the scalars, trackers are optional."""

import json
import logging
import math
import struct
import sys

import numpy as np
import pytest
import torch

from mm_rl.trainer.metrics import MetricsLogger, plot_metrics, read_metrics, step_line, truncate_after


def _log_steps(out_dir, steps, **kwargs):
    with MetricsLogger(out_dir, tensorboard=False, **kwargs) as metrics:
        for step in steps:
            metrics.log(step, {"reward/score": step / 10, "actor/kl_loss": 0.001 * step})
    return out_dir / "metrics.jsonl"


def test_jsonl_round_trip_converts_tensors_and_numpy(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as metrics:
        metrics.log(1, {"a": torch.tensor(0.5), "b": np.float32(0.25), "c": np.int64(3), "d": 2})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "a": 0.5, "b": 0.25, "c": 3.0, "d": 2.0}]


def test_each_step_is_on_disk_before_close(tmp_path):
    metrics = MetricsLogger(tmp_path, tensorboard=False)
    metrics.log(1, {"x": 1.0})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "x": 1.0}]
    metrics.close()
    metrics.close()


def test_non_finite_values_are_null(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as metrics:
        metrics.log(1, {"nan": float("nan"), "inf": torch.tensor(float("inf")), "ok": 1.0})
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    assert json.loads(line) == {"step": 1, "nan": None, "inf": None, "ok": 1.0}


def test_torn_last_line_is_tolerated_and_repaired_on_reopen(tmp_path):
    path = _log_steps(tmp_path, [1, 2])
    with path.open("a") as f:
        f.write('{"step": 3, "reward/sc')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    _log_steps(tmp_path, [3])
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]


def test_corrupt_middle_line_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=":2:"):
        read_metrics(path)


def test_truncate_after_drops_later_steps_for_resume(tmp_path):
    path = _log_steps(tmp_path, [1, 2, 3, 4])
    truncate_after(path, 2)
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    _log_steps(tmp_path, [3])
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    truncate_after(tmp_path / "missing.jsonl", 1)


def test_tensorboard_event_file_holds_the_scalar(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as metrics:
        metrics.log(1, {"reward/score": 0.5})
        metrics.log(2, {"reward/score": 0.75})
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("reward/score")
    assert [(e.step, e.value) for e in scalars] == [(1, 0.5), (2, 0.75)]


def test_missing_tracker_gives_one_notice_and_no_crash(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails even where wandb is installed
    monkeypatch.setitem(sys.modules, "swanlab", None)
    with caplog.at_level(logging.WARNING, logger="mm_rl.trainer.metrics"):
        path = _log_steps(tmp_path, [1, 2], wandb=True, swanlab=True, run_name="r")
    notices = [r.getMessage() for r in caplog.records]
    assert sum("wandb" in n for n in notices) == 1
    assert sum("swanlab" in n for n in notices) == 1
    assert len(read_metrics(path)) == 2


def test_step_line_formats_present_keys_and_skips_missing():
    metrics = {
        "reward/score": torch.tensor(0.5321),
        "reward/accuracy": 0.5,
        "actor/kl_loss": 0.00123,
        "response_length/mean": 245.4,
        "timing/step": 12.34,
        "throughput/tok_per_s": 1234.5,
    }
    line = step_line(12, 100, metrics)
    assert line == "step  12/100 | reward 0.532 | acc 0.500 | kl 1.23e-03 | len 245 | time 12.3s | tok/s 1,234"
    assert step_line(3, 10, {"reward/score": 1.0}) == "step  3/10 | reward 1.000"
    assert step_line(1, 1, {"reward/score": float("nan")}) == "step 1/1 | reward nan"


def _png_size(path):
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_plot_writes_a_png_with_train_and_val_curves(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as metrics:
        for step in range(1, 11):
            values = {
                "reward/score": step / 10,
                "reward/accuracy": step / 20,
                "actor/kl_loss": 1e-3 * step,
                "response_length/mean": 100.0 + step,
            }
            if step % 5 == 0:
                values["val/reward/score"] = step / 12
            metrics.log(step, values)
    png = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "plots" / "metrics.png")
    assert png == tmp_path / "plots" / "metrics.png"
    assert png.stat().st_size > 10_000
    width, height = _png_size(png)
    assert 800 <= width <= 2000 and 500 <= height <= 1500
    assert [p.name for p in png.parent.iterdir()] == ["metrics.png"]


def test_plot_of_an_empty_history_still_writes_a_png(tmp_path):
    png = plot_metrics(tmp_path / "missing.jsonl", tmp_path / "empty.png")
    assert png.stat().st_size > 0 and all(math.isfinite(v) for v in _png_size(png))


def test_moe_routing_metrics_by_hand():
    """Two layers of 4 experts, top-2: layer 0 perfectly balanced, layer 1 with one expert taking half of the
    assignments and one assignment dropped; a layer on no rank's stage (no tokens) is left out."""
    from mm_rl.config.schema import TextDecoderConfig
    from mm_rl.workers.training import routing_metrics

    text = TextDecoderConfig(num_moe_experts=4, moe_router_topk=2, moe_intermediate_size=8)
    counts = torch.tensor([[5.0, 5, 5, 5, 10], [10, 5, 3, 1, 10], [0, 0, 0, 0, 0]], dtype=torch.float64)
    metrics = routing_metrics(counts, text)
    # layer 1: 19 assignments over 4 experts, mean 4.75: max 10 / 4.75, min 1 / 4.75
    assert metrics["moe/load_max"] == pytest.approx((1 + 10 / 4.75) / 2)
    assert metrics["moe/load_min"] == pytest.approx((1 + 1 / 4.75) / 2)
    assert metrics["moe/load_max_layer"] == pytest.approx(10 / 4.75)
    assert metrics["moe/dropped_tokens"] == pytest.approx(1 / 40)
    assert routing_metrics(torch.zeros(2, 5, dtype=torch.float64), text) == {}
