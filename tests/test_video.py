"""Video and multi-image prompts: frame sampling, decoding, a data set's rows against the model's own processor
(Qwen2.5-VL: one entry per video with its time step; Qwen3-VL: timestamps, one entry per frame pair), and bad rows
counted, not raised."""

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from mm_rl.data.dataset import BadRow, PromptDataset, PromptProcessor, open_video, video_metadata
from mm_rl.data.video import VideoSampling, VideoSettings, read_video
from mm_rl.demo.synthetic_video import write_synthetic_video
from mm_rl.demo.tiny import build_tiny_checkpoint

MIN_PIXELS, MAX_PIXELS = 56 * 56, 224 * 224
VIDEO = VideoSettings(VideoSampling(fps=2.0, min_frames=4, max_frames=8), 56 * 56, 84 * 84)


@pytest.mark.parametrize(
    ("total", "native_fps", "expected"),
    [
        (90, 30.0, [0, 18, 36, 53, 71, 89]),  # 3 s at 2 fps: 6 frames over the whole clip
        (3000, 30.0, [0, 428, 857, 1285, 1714, 2142, 2571, 2999]),  # 100 s: max_frames, sparser
        (20, 30.0, [0, 6, 13, 19]),  # 0.7 s: min_frames
        (3, 30.0, [0, 2]),  # fewer frames than min_frames: what it has, an even count
        (1, 30.0, [0, 0]),  # one frame: twice (the ViT pairs frames)
        (9, 2.0, [0, 1, 2, 3, 5, 6, 7, 8]),  # 4.5 s: 9 wanted, even and within max_frames
    ],
)
def test_frames_are_sampled_evenly_within_the_limits(total, native_fps, expected):
    indices = VIDEO.sampling.frame_indices(total, native_fps)
    assert indices == expected and len(indices) % 2 == 0


def test_a_video_decodes_from_its_path_and_its_bytes_and_a_bad_one_is_a_bad_row(tmp_path):
    data = write_synthetic_video(tmp_path / "set", train_size=3, test_size=0, frames=5)
    path = data / "videos" / "train_00000.mp4"
    from_path, from_bytes = read_video(path, VIDEO.sampling), read_video(path.read_bytes(), VIDEO.sampling)
    assert from_path.total_num_frames == 5 and from_path.fps == 2.0 and from_path.frames_indices == (0, 1, 3, 4)
    assert [f.tobytes() for f in from_path.frames] == [f.tobytes() for f in from_bytes.frames]
    assert from_path.size == (84, 84) and from_path.metadata()["duration"] == 2.5
    with pytest.raises(BadRow, match="undecodable video"):
        open_video(b"not a video at all", VIDEO.sampling)
    with pytest.raises(BadRow, match="undecodable video frame"):
        open_video((b"not an image",), VIDEO.sampling)


@pytest.fixture(scope="module", params=["qwen2_5vl", "qwen3_vl"])
def family_set(request, tmp_path_factory):
    """A tiny checkpoint of the family, the synthetic video set and rows of every other kind: an image and a video,
    two videos, and bad rows (a file that is no video, a tag without its video)."""
    root = tmp_path_factory.mktemp(request.param)
    model = build_tiny_checkpoint(root / "tiny", seed=0, family=request.param)
    data = write_synthetic_video(root / "set", seed=1, train_size=6, test_size=0)
    (data / "broken.mp4").write_bytes(b"\x00" * 64)
    odd = [f"odd_{k}.png" for k in range(7)]  # 7 frames of 75 x 61: resized by the processor, sampled to 6
    for k, name in enumerate(odd):
        Image.new("RGB", (75, 61), (30 * k, 90, 200 - 20 * k)).save(data / name)
    extra = [
        {"prompt": "<image>then<video>Find x.", "images": ["images/train_00002_0.png"],
         "videos": ["videos/train_00000.mp4"], "answer": "1"},
        {"prompt": "<video>and<video>Find x.", "videos": ["videos/train_00000.mp4",
         [f"frames/train_00004_{k}.png" for k in range(6)]], "answer": "2"},
        {"prompt": "<video>Find x.", "videos": ["broken.mp4"], "answer": "3"},
        {"prompt": "<video><video>Find x.", "videos": ["videos/train_00000.mp4"], "answer": "4"},
        {"prompt": "<video>Find x.", "videos": [odd], "answer": "5"},
    ]  # fmt: skip
    with (data / "train.jsonl").open("a", encoding="utf-8") as rows:
        rows.writelines(json.dumps(row) + "\n" for row in extra)
    processor = PromptProcessor(model, MIN_PIXELS, MAX_PIXELS, VIDEO)
    return request.param, processor, PromptDataset(data, "train", processor, max_prompt_length=1024)


def test_video_rows_are_what_the_models_own_processor_makes(family_set):
    """Each row's ids and pixels equal transformers' processor's (images and videos apart there, in pad order
    here); the length counted without processing equals the ids'; the entries follow the family's rule."""
    family, processor, dataset = family_set
    assert len(dataset) == 9 and dataset.stats.bad == {"undecodable video": 1, "video placeholders != videos": 1}
    video_pad = processor.video_token_id
    for index in range(len(dataset)):
        item = dataset[index]
        size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
        kwargs = {"return_tensors": "pt", "images_kwargs": {"size": size}}
        if item.videos:
            kwargs |= {
                "videos": [list(c.frames) for c in item.videos],
                "video_metadata": [video_metadata(c) for c in item.videos],
                "do_sample_frames": False,
                "videos_kwargs": VIDEO.processor_kwargs(),
            }
        expected = processor.full(text=[item.prompt_text], images=item.images or None, **kwargs)
        assert torch.equal(expected["input_ids"][0], item.input_ids), index
        assert dataset.num_tokens(index) == len(item.input_ids)
        pixels = [expected[key] for key in ("pixel_values", "pixel_values_videos") if key in expected]
        first_image = item.images and item.input_ids.tolist().index(processor.image_token_id) < (
            item.input_ids.tolist().index(video_pad) if item.videos else len(item.input_ids)
        )
        assert torch.equal(item.pixel_values, torch.cat(pixels if first_image else pixels[::-1])), index
        assert dataset.video_frames(index) == [len(c.frames) for c in item.videos]
        if not item.videos:
            assert item.mrope_time_steps is None
            continue
        video_grids = expected["video_grid_thw"]
        entries = item.image_grid_thw[item.image_grid_thw[:, 0] > 0]
        if family == "qwen3_vl":  # timestamps between frame pairs: each pair an entry of its own
            frame_rows = torch.cat([g[1:].repeat(int(g[0]), 1) for g in video_grids])
            tail = entries[-len(frame_rows) :]
            assert torch.equal(tail[:, 1:], frame_rows) and (tail[:, 0] == 1).all()
            assert torch.equal(item.mrope_time_steps, torch.ones(len(item.image_grid_thw), dtype=torch.float64))
        else:  # one entry per video, time ids spaced by tokens_per_second x second_per_grid_t
            assert torch.equal(entries[-len(video_grids) :], video_grids)
            steps = item.mrope_time_steps[-len(video_grids) :]
            assert torch.allclose(steps, 2 * expected["second_per_grid_ts"].double())  # tokens_per_second 2


def test_a_missing_video_column_is_named(tmp_path):
    from mm_rl.data.dataset import parse_fields

    keys = {"prompt": "prompt", "answer": "answer", "image": "images", "video": "clips"}
    with pytest.raises(BadRow, match="missing field 'clips'"):
        parse_fields({"prompt": "<video>Find x.", "answer": "1"}, Path(tmp_path), keys, "")


def test_video_positions_are_vllms():
    """mm_rl's mRoPE ids of a row with an image and two videos (time steps 2.25 and 0.75: truncated products, a
    repeated time id) equal vLLM's own ``get_mrope_input_positions`` (Qwen2.5-VL), called on a stand-in ``self``
    holding what it reads; the engine generates from these positions, the actor trains on mm_rl's."""
    import functools
    from types import SimpleNamespace

    from mm_rl.platform import cpu_wheels

    cpu_wheels.install()  # vLLM's Qwen2.5-VL module imports torchvision
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as Vllm

    from mm_rl.models.qwen_vl.rope_index import get_rope_index

    image, video, start, end = 1006, 1007, 1003, 1004
    items = [("image", (1, 4, 6), None), ("video", (3, 4, 4), 1.125), ("video", (4, 2, 6), 0.375)]
    ids, features = list(range(5)), []
    for modality, grid, seconds in items:
        ids.append(start)
        data = {f"{modality}_grid_thw": SimpleNamespace(data=torch.tensor(grid))}
        if seconds is not None:
            data["second_per_grid_ts"] = SimpleNamespace(data=torch.tensor(seconds))
        count = grid[0] * grid[1] * grid[2] // 4
        features.append(SimpleNamespace(modality=modality, data=data, mm_position=SimpleNamespace(offset=len(ids))))
        ids += [image if modality == "image" else video] * count + [end] + list(range(7, 10))
    vision = SimpleNamespace(spatial_merge_size=2, tokens_per_second=2)
    engine = SimpleNamespace(config=SimpleNamespace(vision_config=vision))
    engine.iter_mm_grid_thw = functools.partial(Vllm.iter_mm_grid_thw, engine)
    expected, delta = Vllm.get_mrope_input_positions(engine, ids, features)
    steps = torch.tensor([1.0, 2 * 1.125, 2 * 0.375], dtype=torch.float64)
    grids = torch.tensor([grid for _, grid, _ in items])
    ours, deltas = get_rope_index(
        torch.tensor([ids]), grids, image_token_id=image, video_token_id=video, time_steps=steps
    )
    assert torch.equal(ours[:, 0], expected.long()) and int(deltas) == delta
    unscaled, _ = get_rope_index(torch.tensor([ids]), grids, image_token_id=image, video_token_id=video)
    assert not torch.equal(unscaled[:, 0], expected.long())  # the time steps matter
