"""Driver-side pieces of the trainer that need no Ray: micro-batch layout, per-sample round trips, the step's
images and how a rank puts a micro-batch's images together, how they cross into a rank's process (packed), the
sampling seeds and the submit path handling."""

import pickle
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from ray_utils import through_object_store

from mm_rl.platform.transfer import Packed, image_inputs
from mm_rl.trainer.batch import (
    Sample,
    balanced_shards,
    by_count,
    by_tokens,
    computed_tokens,
    micro_batches,
    padded,
    padding_share,
    response_values,
    step_images,
    tokens,
)
from mm_rl.trainer.grpo import sampling_seed

PAD = 0


def _item(image_tokens: int) -> SimpleNamespace:
    grid = torch.tensor([[1, 2, image_tokens * 2]]) if image_tokens else torch.zeros(0, 3, dtype=torch.long)
    return SimpleNamespace(
        pixel_values=torch.randn(int(grid.prod(-1).sum()), 8), image_grid_thw=grid, mrope_time_steps=None
    )


def _samples() -> tuple[list[Sample], dict[int, SimpleNamespace]]:
    items = {0: _item(2), 1: _item(0)}
    samples = [
        Sample(0, 0, [5, 6, 7], [8, 9], "stop"),
        Sample(1, 1, [5, 6], [10, 11, 12, 13], "length"),
        Sample(0, 0, [5, 6, 7], [14], "stop"),
    ]
    for s in samples:
        s.old_log_probs = torch.arange(s.response_len, dtype=torch.float32) - 10 * s.response_len
        s.advantages = torch.full((s.response_len,), float(s.response_len))
    return samples, items


def test_micro_batches_put_response_values_where_labels_predict_them():
    samples, items = _samples()
    batches = micro_batches(by_count(samples, 2), items, PAD, ("old_log_probs", "advantages"))
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
    # rows name their prompt; only the rows with images contribute grids, in row order; no pixels travel
    assert first["image_index"].tolist() == [0, 1] and "pixel_values" not in first
    assert torch.equal(first["image_grid_thw"], items[0].image_grid_thw)
    assert "image_grid_thw" not in micro_batches([samples[1:2]], items, PAD)[0]


def test_a_groups_later_rows_name_the_prompt_they_share_with_the_row_before():
    """The model computes a shared prompt once: a row shares all of its prompt but the last token (which predicts
    its first response token) with the row before it when both answer the same prompt with the same ids; a
    different prompt, or the same one truncated otherwise, shares nothing."""
    items = {0: _item(2), 1: _item(0)}
    samples = [
        Sample(0, 0, [5, 6, 7], [8, 9], "stop"),
        Sample(0, 0, [5, 6, 7], [14], "stop"),
        Sample(0, 0, [5, 6, 7], [15, 16, 17], "stop"),
        Sample(1, 1, [5, 6, 7], [10], "stop"),  # same ids, another prompt (its image differs)
        Sample(1, 1, [5, 6], [11], "stop"),  # same prompt, other ids
    ]
    (batch,) = micro_batches([samples], items, PAD)
    assert batch["shared_prompt"].tolist() == [0, 2, 2, 0, 0]
    assert micro_batches([samples[1:3]], items, PAD)[0]["shared_prompt"].tolist() == [0, 2]


def test_response_values_read_back_what_micro_batches_wrote():
    samples, items = _samples()
    batches = micro_batches(by_count(samples, 2), items, PAD, ("old_log_probs",))
    back = response_values(by_count(samples, 2), [b["old_log_probs"] for b in batches])
    assert all(torch.equal(b, s.old_log_probs) for b, s in zip(back, samples, strict=True))
    values, mask = padded(samples, "advantages")
    assert values.shape == (3, 4) and mask.sum(-1).tolist() == [2, 4, 1]


def _long_tailed(groups: int = 6, n: int = 4, seed: int = 0) -> list[Sample]:
    """Groups of n samples with prompts of 10-40 tokens and long-tailed responses of 1-60 tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for group in range(groups):
        prompt = list(range(int(torch.randint(10, 41, (1,), generator=g))))
        for _ in range(n):
            length = min(60, 1 + int(torch.empty(1).exponential_(0.08, generator=g)))
            out.append(Sample(group, group, prompt, [1] * length, "stop"))
    return out


def test_token_budget_runs_hold_every_sample_once_within_the_budget_in_order():
    samples = _long_tailed()
    for budget in (100, 160, 400):
        runs = by_tokens(samples, budget, packed=False)
        assert [s for run in runs for s in run] == samples  # every sample once, in the step's order
        assert all(len(run) * max(map(tokens, run)) <= budget for run in runs)
        assert all(sum(map(tokens, run)) <= budget for run in by_tokens(samples, budget))  # packed: the tokens
        run_of = {id(sample): k for k, run in enumerate(runs) for sample in run}
        for group in {s.group for s in samples}:
            members = [s for s in samples if s.group == group]
            if computed_tokens(members, packed=False) <= budget:  # a group that fits a run is never split
                assert len({run_of[id(s)] for s in members}) == 1
        for a, b in zip(runs, runs[1:], strict=False):  # greedy: what came next did not fit the run before it
            following = [s for s in samples if s.group == b[0].group] if b[0].group != a[-1].group else [b[0]]
            assert computed_tokens([*a, *following], packed=False) > budget
    for sample in samples:
        sample.old_log_probs = torch.randn(sample.response_len)
    runs = by_tokens(samples, 160)
    batches = micro_batches(runs, {s.index: _item(0) for s in samples}, PAD, ("old_log_probs",))
    back = response_values(runs, [b["old_log_probs"] for b in batches])
    assert all(torch.equal(b, s.old_log_probs) for b, s in zip(back, samples, strict=True))
    assert len(by_tokens(samples, 100)) > len(by_tokens(samples, 400))
    assert padding_share(by_tokens(samples, 100, packed=False)) < padding_share(by_count(samples, 8))
    assert padding_share(by_count(samples, 8), packed=True) == 0.0
    assert len(by_tokens(samples, 160)) < len(by_tokens(samples, 160, packed=False))  # packed rows fit more
    with pytest.raises(ValueError, match="does not fit the micro-batch budget of 20 tokens"):
        by_tokens(samples, 20)


def test_balanced_shards_even_out_tokens_and_keep_groups_whole():
    samples = _long_tailed(groups=9)
    shards = balanced_shards(samples, 3)
    assert sorted(id(s) for shard in shards for s in shard) == sorted(map(id, samples))
    loads = [sum(map(tokens, shard)) for shard in shards]
    contiguous = [sum(map(tokens, samples[i * 12 : (i + 1) * 12])) for i in range(3)]
    assert max(loads) - min(loads) <= max(contiguous) - min(contiguous)
    assert max(loads) - min(loads) <= max(sum(map(tokens, samples[i : i + 4])) for i in range(0, 36, 4))
    assert all(len({s.group for s in shard}) * 4 == len(shard) for shard in shards)  # whole groups
    assert all(shard == sorted(shard, key=samples.index) for shard in shards)  # the step's order
    few = balanced_shards(samples[:4], 2)  # one group, two replicas: the group is split, no replica idle
    assert all(few) and sorted(id(s) for shard in few for s in shard) == sorted(map(id, samples[:4]))
    with pytest.raises(ValueError, match="3 samples cannot fill 4"):
        balanced_shards(samples[:3], 4)


def test_micro_batches_and_images_cross_processes_as_one_packed_buffer():
    """What the driver puts into Ray's object store for the ranks (pickle protocol 5, buffers out of band, mapped
    read-only by the reader) arrives as the same structure with equal tensors (any dtype, views, scalars, empty),
    from one buffer the receiver owns and may write; a tensor on a device is refused (results leave through
    ``to_host`` first)."""
    samples, items = _samples()
    batches = micro_batches(by_count(samples, 2), items, PAD, ("old_log_probs", "advantages"))
    value = {
        "shards": [batches],
        "images": step_images(samples, items),
        "odd": (torch.randn(4, 6).to(torch.bfloat16)[:, ::2], torch.tensor(3.0), torch.zeros(0, 4), "text", 7),
    }
    out, buffers = through_object_store(Packed(value))
    assert buffers == 1

    def same(got, want):
        assert type(got) is type(want)
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and torch.equal(got, want)
        elif isinstance(want, dict):
            assert list(got) == list(want) and all(same(got[k], want[k]) for k in want)
        elif isinstance(want, list | tuple):
            assert len(got) == len(want) and all(same(g, w) for g, w in zip(got, want, strict=True))
        else:
            assert got == want
        return True

    same(out, value)
    first = out["shards"][0][0]["input_ids"]
    first.add_(1)  # writable, and the sender's tensor is its own
    assert torch.equal(first, batches[0]["input_ids"] + 1)
    nothing = {0: (torch.zeros(0, 8), torch.zeros(0, 3, dtype=torch.long))}  # a text-only step: only empty tensors
    same(through_object_store(Packed(nothing))[0], nothing)
    with pytest.raises(ValueError, match="meta tensor cannot travel packed"):
        pickle.dumps(Packed([torch.zeros(2, device="meta")]), protocol=5)


def test_sampling_seeds_differ_per_step_and_batch_and_repeat():
    seeds = {sampling_seed(1234, step, batch) for step in range(1, 50) for batch in range(-1, 4)}
    assert len(seeds) == 49 * 5
    assert sampling_seed(1234, 7, 0) == sampling_seed(1234, 7, 0)


def test_submit_makes_directly_set_relative_paths_absolute(tmp_path):
    from mm_rl.job.submit import absolute_paths

    node = OmegaConf.create(
        {
            "af_output_dir": "./out",
            "backend_config": {
                "megatron_training": {"tokenizer_name_or_path": "${af_output_dir}/hf", "save": "/abs/ckpt"},
                "data": {"dataset_param": {"basic_parameters": {"dataset_dir": "data"}}},
            },
        }
    )
    absolute_paths(node, tmp_path)
    assert node.af_output_dir == str(tmp_path / "out")
    assert node.backend_config.megatron_training.tokenizer_name_or_path == str(tmp_path / "out" / "hf")
    assert node.backend_config.megatron_training.save == "/abs/ckpt"
    assert node.backend_config.data.dataset_param.basic_parameters.dataset_dir == str(tmp_path / "data")


@pytest.mark.parametrize(
    "device, colocate, actor, engine",
    [("cuda", False, 6, {"CPU": 1.0, "GPU": 2.0}), ("npu", True, 8, None), ("cpu", False, 8, None)],
)
def test_a_separate_engine_gets_whole_devices_of_its_own(device, colocate, actor, engine):
    """On accelerators ``colocate: false`` takes the engine's devices out of the actor's world into a bundle of
    its own; colocated, or on CPU, every device stays with the actor."""
    from mm_rl.config.loader import load_job
    from mm_rl.trainer.runtime import plan_resources

    gen = "--backend_config.generate_config"
    job = load_job(
        None,
        [
            f"--env.DEVICE={device}",
            "--env.NPROC_PER_NODE=8",
            f"{gen}.colocate={colocate}",
            f"{gen}.infer_tensor_parallel_size={2 if engine else 1}",
        ],
    )
    resources = plan_resources(job)
    assert resources.world_size == actor
    assert (resources.rollout_bundle() if resources.rollout_devices else None) == engine


def _prompt(grids: list[tuple[int, int, int]], generator: torch.Generator) -> SimpleNamespace:
    grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    return SimpleNamespace(
        pixel_values=torch.randn(int(grid.prod(-1).sum()), 8, generator=generator),
        image_grid_thw=grid,
        mrope_time_steps=None,
    )


def test_a_rank_puts_together_each_prompts_images_once_and_which_fills_each_slot():
    """Prompts with one image, two images of different sizes and none, their samples in any order: the step's
    images hold each prompt once, and per micro-batch the rank encodes each distinct prompt's images once while
    ``pixel_values[image_slots]`` (by patch blocks) is what one copy per sample was."""
    g = torch.Generator().manual_seed(0)
    items = {7: _prompt([(1, 2, 4)], g), 3: _prompt([(1, 2, 2), (1, 4, 2)], g), 5: _prompt([], g)}
    order = [7, 3, 7, 5, 3, 7, 5, 3]
    samples = [Sample(index, 0, [1, 2], [4], "stop") for index in order]
    images = step_images(samples, items)
    assert list(images) == [7, 3, 5] and images[5][0].numel() == 0
    (batch,) = micro_batches([samples], items, PAD)
    inputs = image_inputs(batch, images)
    assert inputs["encoded_grid_thw"].tolist() == [[1, 2, 4], [1, 2, 2], [1, 4, 2]]  # prompts in order of first use
    assert inputs["image_slots"].tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert torch.equal(inputs["encoded_grid_thw"][inputs["image_slots"]], batch["image_grid_thw"])
    patches = inputs["encoded_grid_thw"].prod(-1)
    blocks = torch.split(inputs["pixel_values"], patches.tolist())
    per_sample = torch.cat([items[i].pixel_values for i in order if items[i].image_grid_thw.numel()])
    assert torch.equal(torch.cat([blocks[k] for k in inputs["image_slots"].tolist()]), per_sample)
    assert inputs["pixel_values"].shape[0] == patches.sum() < per_sample.shape[0]
    (text_only,) = micro_batches([samples[3:4]], items, PAD)
    assert image_inputs(text_only, images) == {}


def test_a_micro_batch_of_another_steps_images_is_refused():
    g = torch.Generator().manual_seed(0)
    items = {0: _prompt([(1, 2, 2)], g), 1: _prompt([(1, 2, 4)], g)}
    (batch,) = micro_batches([[Sample(0, 0, [1], [2], "stop"), Sample(1, 1, [1], [2], "stop")]], items, PAD)
    with pytest.raises(ValueError, match=r"prompts \[1\] are not among the step's images"):
        image_inputs(batch, {0: (items[0].pixel_values, items[0].image_grid_thw)})
    stale = {0: (items[0].pixel_values, items[0].image_grid_thw), 1: (items[0].pixel_values, items[0].image_grid_thw)}
    with pytest.raises(ValueError, match="image_grid_thw differs"):
        image_inputs(batch, stale)
