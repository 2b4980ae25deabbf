"""The synthetic geo3k-style set: parquet layout, determinism, balance, images, reuse and answers."""

import io
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from mm_rl.demo.synthetic import (
    DATA_SOURCE,
    INSTRUCTION,
    MARKER,
    TEMPLATES,
    answer_space,
    read_marker,
    write_synthetic_geo3k,
)

COLUMNS = ["data_source", "prompt", "images", "ability", "reward_model", "extra_info"]
EXPECTED_TYPES = {
    "data_source": pa.string(),
    "prompt": pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])),
    "images": pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
    "ability": pa.string(),
    "reward_model": pa.struct([("style", pa.string()), ("ground_truth", pa.string())]),
    "extra_info": pa.struct(
        [("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()), ("question", pa.string())]
    ),
}
# Answers the question text alone determines (the other templates need the figure).
TEXT_SOLVERS = [
    (r"One side is (\d+)\.", lambda a: a),
    (r"with one leg (\d+)\.", lambda a: a),
    (r"perimeter of the square is (\d+)\.", lambda p: p / 4),
    (r"triangle are (\d+) and (\d+) degrees", lambda a, b: (180 - a - b) / 10),
    (r"diameter of the circle is (\d+)\.", lambda d: d / 2),
    (r"AC = (\d+) and AB = (\d+)\.", lambda total, first: total - first),
]


@pytest.fixture(scope="module")
def default_set(tmp_path_factory):
    return write_synthetic_geo3k(tmp_path_factory.mktemp("geo") / "set")


def rows(path):
    return pq.read_table(path).to_pylist()


def test_writes_both_splits(default_set):
    out = default_set
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "test.parquet", "train.parquet"])
    assert len(rows(out / "train.parquet")) == 512 and len(rows(out / "test.parquet")) == 64
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")], "staging directories left behind"


def test_schema_is_the_verl_geo3k_layout(default_set):
    out = default_set
    for split in ("train", "test"):
        schema = pq.read_schema(out / f"{split}.parquet")
        assert schema.names == COLUMNS
        assert {name: schema.field(name).type for name in COLUMNS} == EXPECTED_TYPES


def test_rows_follow_the_conventions(default_set):
    out = default_set
    for split in ("train", "test"):
        for index, row in enumerate(rows(out / f"{split}.parquet")):
            (message,) = row["prompt"]
            problem = row["extra_info"]["question"]
            truth = row["reward_model"]["ground_truth"]
            assert message == {"role": "user", "content": "<image>" + problem + " " + INSTRUCTION}
            assert len(problem.split()) < 60
            assert row["data_source"] == DATA_SOURCE and row["ability"] == "math"
            assert row["reward_model"]["style"] == "rule"
            assert truth in answer_space() and len(truth) == 1
            assert row["extra_info"] == {"split": split, "index": index, "answer": truth, "question": problem}
            assert len(row["images"]) == 1 and row["images"][0]["path"] is None


def test_instruction_is_geo3k_s():
    assert INSTRUCTION.startswith("You FIRST think about the reasoning process as an internal monologue")
    assert INSTRUCTION.endswith("The final answer MUST BE put in \\boxed{}.")
    assert answer_space() == [str(i) for i in range(1, 10)]


def test_classes_are_balanced(default_set):
    out = default_set
    train = rows(out / "train.parquet")
    counts = {a: 0 for a in answer_space()}
    for row in train:
        counts[row["reward_model"]["ground_truth"]] += 1
    assert min(counts.values()) >= len(train) / len(counts) / 2, counts
    marker = read_marker(out)
    assert marker["classes"]["train"] == counts
    assert sum(marker["templates"]["train"].values()) == len(train)
    assert all(marker["templates"]["train"][t.name] > 0 for t in TEMPLATES)


def test_images_decode_to_rgb_squares(default_set):
    out = default_set
    for row in rows(out / "test.parquet")[:32]:
        image = Image.open(io.BytesIO(row["images"][0]["bytes"]))
        assert image.format == "PNG" and image.mode == "RGB" and image.size == (112, 112)
        image.load()
        assert len(image.getcolors(112 * 112)) > 2, "a blank image"


def test_text_answers_are_consistent(default_set):
    out = default_set
    solved = 0
    for row in rows(out / "train.parquet"):
        problem = row["extra_info"]["question"]
        for pattern, solve in TEXT_SOLVERS:
            if match := re.search(pattern, problem):
                assert solve(*map(int, match.groups())) == int(row["reward_model"]["ground_truth"]), problem
                solved += 1
    assert solved > 512 / 3


def test_splits_are_disjoint(default_set):
    out = default_set
    train = {r["images"][0]["bytes"] for r in rows(out / "train.parquet")}
    test = {r["images"][0]["bytes"] for r in rows(out / "test.parquet")}
    assert len(train) == 512 and len(test) == 64 and not train & test


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    small = {"train_size": 40, "test_size": 10}
    a = write_synthetic_geo3k(tmp_path / "a", seed=3, **small)
    b = write_synthetic_geo3k(tmp_path / "b", seed=3, **small)
    c = write_synthetic_geo3k(tmp_path / "c", seed=4, **small)
    for name in ("train.parquet", "test.parquet"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
        assert (a / name).read_bytes() != (c / name).read_bytes()


def test_rerun_reuses_and_other_args_rewrite(tmp_path):
    out = write_synthetic_geo3k(tmp_path / "set", train_size=20, test_size=5)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert write_synthetic_geo3k(out, train_size=20, test_size=5) == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    before = (out / "train.parquet").read_bytes()
    write_synthetic_geo3k(out, train_size=20, test_size=5, image_size=64)
    assert read_marker(out)["args"]["image_size"] == 64
    assert (out / "train.parquet").read_bytes() != before
    image = Image.open(io.BytesIO(rows(out / "train.parquet")[0]["images"][0]["bytes"]))
    assert image.size == (64, 64)


def test_refuses_foreign_directories_and_bad_args(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        write_synthetic_geo3k(tmp_path / "mine", train_size=2, test_size=2)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    (tmp_path / "empty").mkdir()
    assert (write_synthetic_geo3k(tmp_path / "empty", train_size=2, test_size=2) / "train.parquet").is_file()
    with pytest.raises(ValueError):
        write_synthetic_geo3k(tmp_path / "tiny", image_size=16)
