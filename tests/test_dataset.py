"""The prompt data set (three on-disk forms, bad rows, length filter, processor parity) and the resumable sampler."""

import base64
import io
import json
import logging
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from mm_rl.config.schema import DataConfig
from mm_rl.data.dataset import DEFAULT_INSTRUCTION, PromptDataset, PromptProcessor, to_rgb
from mm_rl.data.sampler import PromptSampler
from mm_rl.demo.synthetic import write_synthetic_geo3k
from mm_rl.demo.tiny import IMAGE_TOKEN_ID, build_tiny_checkpoint
from mm_rl.platform import cpu_wheels

cpu_wheels.install()  # the reference AutoProcessor builds the video processor, which imports torchvision

MIN_PIXELS, MAX_PIXELS = 56 * 56, 224 * 224


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="module")
def processor(tiny_dir):
    return PromptProcessor(tiny_dir, MIN_PIXELS, MAX_PIXELS)


@pytest.fixture(scope="module")
def verl_dir(tmp_path_factory):
    return write_synthetic_geo3k(tmp_path_factory.mktemp("geo") / "set", train_size=12, test_size=3)


def png(size=(70, 56), color=(200, 30, 30), mode="RGB"):
    buffer = io.BytesIO()
    Image.new(mode, size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")


def reference_inputs(tiny_dir, text, images):
    """What transformers' own Qwen2.5-VL processor makes of the same chat and images."""
    from transformers import AutoProcessor

    bounds = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    reference = AutoProcessor.from_pretrained(tiny_dir, size=bounds)
    assert (reference.image_processor.size.shortest_edge, reference.image_processor.size.longest_edge) == (
        MIN_PIXELS,
        MAX_PIXELS,
    )
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    prompt = reference.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    return prompt, reference(text=[prompt], images=images, return_tensors="pt")


# ------------------------------------------------------------------------------------------- the forms
def test_verl_parquet_items(verl_dir, processor):
    dataset = PromptDataset(verl_dir, "train", processor)
    row = pq.read_table(verl_dir / "train.parquet").slice(0, 1).to_pylist()[0]
    assert dataset.form == "verl" and len(dataset) == 12 and dataset.stats.kept == 12
    item = dataset[0]
    assert item.row_id == 0 and item.ground_truth == row["reward_model"]["ground_truth"]
    assert item.prompt_text.count("<|image_pad|>") == 1 and item.prompt_text.endswith("<|im_start|>assistant\n")
    assert DEFAULT_INSTRUCTION in item.prompt_text and item.prompt_text.count(DEFAULT_INSTRUCTION) == 1
    assert item.images[0].mode == "RGB" and item.image_grid_thw.dtype == torch.long
    assert int((item.input_ids == IMAGE_TOKEN_ID).sum()) == int(item.image_grid_thw.prod()) // 4
    assert dataset.num_tokens(0) == item.input_ids.numel()


def test_items_match_the_transformers_processor(tiny_dir, verl_dir, processor):
    dataset = PromptDataset(verl_dir, "test", processor)
    row = pq.read_table(verl_dir / "test.parquet").slice(1, 1).to_pylist()[0]
    image = Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB")
    prompt, expected = reference_inputs(tiny_dir, row["prompt"][0]["content"].replace("<image>", ""), [image])
    item = dataset[1]
    assert item.prompt_text == prompt
    assert torch.equal(item.input_ids, expected["input_ids"][0])
    assert torch.equal(item.image_grid_thw, expected["image_grid_thw"])
    assert torch.equal(item.pixel_values, expected["pixel_values"])


def test_pixel_bounds_reach_the_image_processor(tiny_dir, verl_dir):
    small = PromptDataset(verl_dir, "test", PromptProcessor(tiny_dir, 56 * 56, 56 * 56))[0]
    large = PromptDataset(verl_dir, "test", PromptProcessor(tiny_dir, 196 * 196, 224 * 224))[0]
    assert small.image_grid_thw.tolist() == [[1, 4, 4]]  # 112 px shrunk to 56 px: 4 x 4 patches
    t, h, w = large.image_grid_thw[0].tolist()
    assert 196 * 196 <= h * w * 14 * 14 <= 224 * 224 and small.input_ids.numel() < large.input_ids.numel()


def test_raw_geometry3k_layout(tmp_path, processor):
    (tmp_path / "data").mkdir()
    table = pa.table(
        {
            "images": [[{"bytes": png(), "path": None}], [{"bytes": png((40, 90)), "path": "b.png"}]],
            "problem": ["<image>Find x.", "<image>Find the area of the circle."],
            "answer": ["5", "12.57"],
            "id": ["g1", "g2"],
            "ground_truth": ["B", "C"],  # the choice letter: must not be taken for the answer
        }
    )
    pq.write_table(table, tmp_path / "data" / "validation-00000-of-00001.parquet")
    dataset = PromptDataset(tmp_path, "validation", processor)
    assert dataset.form == "geometry3k" and len(dataset) == 2
    item = dataset[1]
    assert item.ground_truth == "12.57"
    assert (
        "<|vision_start|><|image_pad|><|vision_end|>Find the area of the circle. " + DEFAULT_INSTRUCTION
        in item.prompt_text
    )


def test_jsonl_with_files_base64_and_custom_keys(tmp_path, tiny_dir, processor):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png())
    encoded = base64.b64encode(png((60, 60), (0, 0, 255))).decode()
    write_jsonl(
        tmp_path / "train.jsonl",
        [
            {"question": "<image>Find x.", "meta": {"label": 3}, "pics": ["img/a.png"]},
            {"question": "Find y.", "meta": {"label": "4"}, "pics": "data:image/png;base64," + encoded},
            {"question": "<image> vs <image>", "meta": {"label": "7"}, "pics": [encoded, {"path": "img/a.png"}]},
        ],
    )
    dataset = PromptDataset(
        tmp_path,
        "train",
        processor,
        prompt_key="question",
        answer_key="meta.label",
        image_key="pics",
        instruction="Box it.",
    )
    assert dataset.form == "jsonl" and len(dataset) == 3 and dataset[0].ground_truth == "3"
    no_placeholder = dataset[1]  # images without a placeholder go before the text
    assert "<|vision_start|><|image_pad|><|vision_end|>Find y. Box it.<|im_end|>" in no_placeholder.prompt_text
    two = dataset[2]
    assert two.prompt_text.count("<|image_pad|>") == 2 and two.image_grid_thw.shape == (2, 3)
    assert int((two.input_ids == IMAGE_TOKEN_ID).sum()) == int(two.image_grid_thw.prod(-1).sum()) // 4
    _, expected = reference_inputs(tiny_dir, "Find x. Box it.", [Image.open(tmp_path / "img" / "a.png")])
    assert torch.equal(dataset[0].input_ids, expected["input_ids"][0])


def test_transparent_images_are_composited_on_white():
    clear = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    assert to_rgb(clear).getpixel((0, 0)) == (255, 255, 255)


def test_from_config(verl_dir, processor):
    data = DataConfig()
    data.dataset_param.basic_parameters.dataset_dir = str(verl_dir)
    assert len(PromptDataset.from_config(data, "val", processor)) == 3


# --------------------------------------------------------------------------------------- bad and long
def test_bad_rows_are_skipped_with_one_summary(tmp_path, processor, caplog):
    (tmp_path / "ok.png").write_bytes(png())
    (tmp_path / "broken.png").write_bytes(png()[:40])
    good = {"prompt": "<image>Find x.", "answer": "2", "images": ["ok.png"]}
    write_jsonl(
        tmp_path / "train.jsonl",
        [
            good,
            {"prompt": "<image>Find x.", "images": ["ok.png"]},  # 1: no answer
            {**good, "images": ["broken.png"]},  # 2: truncated png
            {**good, "answer": "  "},  # 3: empty answer
            "{not json",  # 4
            {**good, "images": ["missing.png"]},  # 5: neither a file nor base64
            {**good, "prompt": "<image><image>Two?"},  # 6: two placeholders, one image
            {"prompt": "<image>Find x.", "answer": "2"},  # 7: no images field
            good,
        ],
    )
    with caplog.at_level(logging.WARNING, logger="mm_rl.data.dataset"):
        dataset = PromptDataset(tmp_path, "train", processor)
    assert len(dataset) == 2 and [dataset.row_id(i) for i in range(2)] == [0, 8]
    assert dataset.stats.rows == 9 and sum(dataset.stats.bad.values()) == 7
    assert dataset.stats.bad["missing field 'reward_model.ground_truth'"] == 1
    assert dataset.stats.bad["undecodable image"] == 1 and dataset.stats.bad["missing field 'images'"] == 1
    assert len(caplog.records) == 1
    assert "skipped 7 of 9 rows" in caplog.text and "rows 1, 2, 3, 4, 5, ..." in caplog.text


def test_no_usable_row_is_a_clear_error(tmp_path, processor):
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "<image>x", "answer": "", "images": []}])
    with pytest.raises(ValueError, match=rf"no usable row in {tmp_path}.*empty answer"):
        PromptDataset(tmp_path, "train", processor)
    with pytest.raises(ValueError, match=r"has no 'test' split: looked for test.parquet"):
        PromptDataset(tmp_path, "test", processor)


def test_long_prompts_are_filtered_and_counted(verl_dir, processor, caplog):
    lengths = sorted(PromptDataset(verl_dir, "train", processor).num_tokens(i) for i in range(12))
    assert lengths[0] < lengths[-1]
    limit = lengths[len(lengths) // 2]
    with caplog.at_level(logging.WARNING, logger="mm_rl.data.dataset"):
        dataset = PromptDataset(verl_dir, "train", processor, max_prompt_length=limit)
    kept = sum(n <= limit for n in lengths)
    assert len(dataset) == kept and dataset.stats.too_long == 12 - kept
    assert all(dataset[i].input_ids.numel() <= limit for i in range(len(dataset)))
    assert f"longer than max_prompt_length={limit}" in caplog.text
    with pytest.raises(ValueError, match="12 longer than max_prompt_length=10"):
        PromptDataset(verl_dir, "train", processor, max_prompt_length=10)


def test_a_split_no_row_of_which_fits_is_a_job_error_naming_the_key_to_change(verl_dir, tmp_path, processor):
    """Known only once every row is processed (in ``train``, before any process starts): check's format, naming
    max_prompt_length when every row was only too long, the data set when the rows are bad (truncated PNGs)."""
    from mm_rl.config.loader import ConfigError

    data = DataConfig()
    data.dataset_param.basic_parameters.dataset_dir = str(verl_dir)
    data.dataset_param.preprocess_parameters.max_prompt_length = 10
    with pytest.raises(ConfigError) as err:
        PromptDataset.from_config(data, "train", processor)
    (problem,) = err.value.violations
    assert problem.key.endswith("preprocess_parameters.max_prompt_length") and problem.value == 10
    assert "12 longer than max_prompt_length=10" in problem.rule and "raise it to at least" in problem.fix
    truncated = png()[:60]  # a PNG cut short: its header opens, its pixels do not decode
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "<image>x", "answer": "1", "images": [base64.b64encode(
        truncated).decode()]}] * 3)  # fmt: skip
    data.dataset_param.basic_parameters.dataset_dir = str(tmp_path)
    with pytest.raises(ConfigError) as err:
        PromptDataset.from_config(data, "train", processor)
    (problem,) = err.value.violations
    assert problem.key.endswith("basic_parameters.dataset_dir") and "3 undecodable image" in problem.rule


# ------------------------------------------------------------------------------------------- sampler
def test_sampler_resumes_with_the_next_unseen_prompt():
    original = PromptSampler(10, 3, seed=7)
    for _ in range(3):
        next(original)
    state = original.state_dict()
    resumed = PromptSampler(10, 3, seed=7)
    resumed.load_state_dict(state)
    assert [next(resumed) for _ in range(5)] == [next(original) for _ in range(5)]  # crosses two epochs


def test_sampler_peek_is_the_next_draw_and_moves_nothing():
    sampler = PromptSampler(10, 4, seed=3)  # 2 batches per epoch: the third peek crosses into epoch 1
    for _ in range(5):
        state = sampler.state_dict()
        peeked = sampler.peek()
        assert sampler.state_dict() == state and sampler.peek() == peeked
        assert next(sampler) == peeked
    assert sampler.epoch == 2


def test_prefetched_rows_are_the_next_draws_and_move_no_state(verl_dir, processor, monkeypatch, request):
    """The rows processed ahead (in the background thread) are those the next draw asks for, equal to rows
    processed on the spot; the sampler does not move; a draw of other rows drops them; a row that fails to process
    fails the draw it belongs to; a decode waits for the prefetch (the processor has one user at a time); the
    helper threads run torch on one thread (no OpenMP team of their own beside the main thread's)."""
    from mm_rl.trainer.prompts import PromptSource

    suite_threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the suite runs torch on one thread: helper threads would take two
    request.addfinalizer(lambda: torch.set_num_threads(suite_threads))
    train = PromptDataset(verl_dir, "train", processor)
    ahead, plain = (PromptSource(processor, train, None, PromptSampler(len(train), 4, seed=5)) for _ in range(2))
    for _ in range(4):  # 3 batches per epoch: the fourth prefetch reads the next epoch's order
        state = ahead.state_dict()
        ahead.prefetch()
        assert ahead.state_dict() == state
        indices = ahead.next_indices()
        assert indices == plain.next_indices()
        got, expected = ahead.requests(indices), plain.requests(indices)
        assert [r.prompt_ids for r in got] == [r.prompt_ids for r in expected]
        for index in indices:
            assert torch.equal(ahead.cached[index].pixel_values, plain.cached[index].pixel_values)

    ahead.prefetch()
    other = [0, 1]
    assert [r.prompt_ids for r in ahead.requests(other)] == [r.prompt_ids for r in plain.requests(other)]
    assert ahead._ahead is None

    calls, broken, threads = [], set(), []
    load = PromptDataset.__getitem__

    def slow(self, index):
        time.sleep(0.05)
        calls.append(index)
        threads.append(torch.get_num_threads())
        if index in broken:
            raise ValueError(f"row {index} is broken")
        return load(self, index)

    monkeypatch.setattr(PromptDataset, "__getitem__", slow)
    upcoming = ahead.sampler.peek()
    ahead.prefetch()
    ahead.decode([[1, 2, 3]])  # waits for the prefetch: the tokenizer has one user at a time
    assert calls == upcoming
    ahead.requests(ahead.next_indices())
    assert calls == upcoming  # the draw took the rows processed ahead
    # the helper thread (and a pool's workers) make no OpenMP team of their own; the main thread keeps its count
    workers = PromptSource(processor, train, None, PromptSampler(len(train), 4, seed=5), num_workers=2)
    workers.requests(workers.next_indices())
    assert threads == [1] * 8 and torch.get_num_threads() == 2

    broken.add(ahead.sampler.peek()[0])
    ahead.prefetch()
    with pytest.raises(ValueError, match=f"row {min(broken)} is broken"):
        ahead.requests(ahead.next_indices())
    ahead.close()
    assert ahead._thread is None


def test_sampler_epochs_are_seeded_shuffles():
    sampler = PromptSampler(10, 4, seed=1)  # drop_last: 2 full batches per epoch
    epochs = [[i for _ in range(2) for i in next(sampler)] for _ in range(3)]
    assert sampler.epoch == 2 and sampler.batches_per_epoch == 2
    assert all(len(set(e)) == 8 for e in epochs) and epochs[0] != epochs[1]
    assert epochs[0] == PromptSampler(10, 4, seed=1).epoch_order(0)[:8]
    assert epochs[0] != PromptSampler(10, 4, seed=2).epoch_order(0)[:8]


def test_sampler_without_drop_last_or_shuffle():
    sampler = PromptSampler(5, 2, seed=0, shuffle=False, drop_last=False)
    assert [next(sampler) for _ in range(4)] == [[0, 1], [2, 3], [4], [0, 1]]


def test_sampler_refuses_a_state_from_another_order():
    state = PromptSampler(10, 3, seed=7).state_dict()
    with pytest.raises(ValueError, match="num_items=10"):
        PromptSampler(11, 3, seed=7).load_state_dict(state)
    with pytest.raises(ValueError, match="cannot fill a batch"):
        PromptSampler(2, 3, seed=0)
