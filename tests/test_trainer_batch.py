"""Driver-side pieces of the trainer that need no Ray: micro-batch layout, per-sample round trips, the
sampling seeds and the submit path handling."""

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from mm_rl.trainer.batch import Sample, micro_batches, padded, response_values
from mm_rl.trainer.grpo import sampling_seed

PAD = 0


def _item(image_tokens: int) -> SimpleNamespace:
    grid = torch.tensor([[1, 2, image_tokens * 2]]) if image_tokens else torch.zeros(0, 3, dtype=torch.long)
    return SimpleNamespace(pixel_values=torch.randn(int(grid.prod(-1).sum()), 8), image_grid_thw=grid)


def _samples() -> tuple[list[Sample], dict[int, SimpleNamespace]]:
    items = {0: _item(2), 1: _item(0)}
    samples = [Sample(0, 0, [5, 6, 7], [8, 9], "stop"), Sample(1, 1, [5, 6], [10, 11, 12, 13], "length"),
               Sample(0, 0, [5, 6, 7], [14], "stop")]
    for s in samples:
        s.old_log_probs = torch.arange(s.response_len, dtype=torch.float32) - 10 * s.response_len
        s.advantages = torch.full((s.response_len,), float(s.response_len))
    return samples, items


def test_micro_batches_put_response_values_where_labels_predict_them():
    samples, items = _samples()
    batches = micro_batches(samples, items, 2, PAD, ("old_log_probs", "advantages"))
    assert [b["input_ids"].shape for b in batches] == [torch.Size([2, 6]), torch.Size([1, 4])]
    first = batches[0]
    assert first["input_ids"][0].tolist() == [5, 6, 7, 8, 9, PAD]
    assert first["attention_mask"][0].tolist() == [1, 1, 1, 1, 1, 0]
    # position s predicts labels[s]: the response tokens are predicted from len(prompt) - 1 on
    mask = first["response_mask"][0].bool()
    assert first["labels"][0][mask].tolist() == [8, 9]
    assert first["labels"][1][first["response_mask"][1].bool()].tolist() == [10, 11, 12, 13]
    assert first["old_log_probs"][0][mask].tolist() == samples[0].old_log_probs.tolist()
    assert first["advantages"][0][~mask].abs().sum() == 0  # nothing outside the response
    # only the rows with images contribute pixels, in row order
    assert torch.equal(first["image_grid_thw"], items[0].image_grid_thw)
    assert "image_grid_thw" not in micro_batches(samples[1:2], items, 2, PAD)[0]


def test_response_values_read_back_what_micro_batches_wrote():
    samples, items = _samples()
    batches = micro_batches(samples, items, 2, PAD, ("old_log_probs",))
    back = response_values(samples, [b["old_log_probs"] for b in batches], 2)
    assert all(torch.equal(b, s.old_log_probs) for b, s in zip(back, samples, strict=True))
    values, mask = padded(samples, "advantages")
    assert values.shape == (3, 4) and mask.sum(-1).tolist() == [2, 4, 1]


def test_sampling_seeds_differ_per_step_and_batch_and_repeat():
    seeds = {sampling_seed(1234, step, batch) for step in range(1, 50) for batch in range(-1, 4)}
    assert len(seeds) == 49 * 5
    assert sampling_seed(1234, 7, 0) == sampling_seed(1234, 7, 0)


def test_submit_makes_directly_set_relative_paths_absolute(tmp_path):
    from mm_rl.trainer.submit import absolute_paths

    node = OmegaConf.create({"af_output_dir": "./out", "backend_config": {
        "megatron_training": {"tokenizer_name_or_path": "${af_output_dir}/hf", "save": "/abs/ckpt"},
        "data": {"dataset_param": {"basic_parameters": {"dataset_dir": "data"}}}}})
    absolute_paths(node, tmp_path)
    assert node.af_output_dir == str(tmp_path / "out")
    assert node.backend_config.megatron_training.tokenizer_name_or_path == str(tmp_path / "out" / "hf")
    assert node.backend_config.megatron_training.save == "/abs/ckpt"
    assert node.backend_config.data.dataset_param.basic_parameters.dataset_dir == str(tmp_path / "data")


@pytest.mark.parametrize("device, colocate, actor, engine", [("cuda", False, 6, {"CPU": 1.0, "GPU": 2.0}),
                                                             ("npu", True, 8, None), ("cpu", False, 8, None)])
def test_a_separate_engine_gets_whole_devices_of_its_own(device, colocate, actor, engine):
    """On accelerators ``colocate: false`` takes the engine's devices out of the actor's world into a bundle of
    its own; colocated, or on CPU, every device stays with the actor."""
    from mm_rl.config.loader import load_job
    from mm_rl.trainer.runtime import plan_resources

    gen = "--backend_config.generate_config"
    job = load_job(None, [f"--env.DEVICE={device}", "--env.NPROC_PER_NODE=8", f"{gen}.colocate={colocate}",
                          f"{gen}.infer_tensor_parallel_size={2 if engine else 1}"])
    resources = plan_resources(job)
    assert resources.world_size == actor
    assert (resources.rollout_bundle() if resources.rollout_devices else None) == engine
