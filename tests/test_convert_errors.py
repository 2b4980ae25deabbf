"""hf2mg / mg2hf user errors (each a clear message naming the file and tensor, nothing half-written left behind)
and the `ascendfactory-cli convert` command (job yaml or flags, exit 1 without a traceback)."""

import importlib
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from test_convert import hf_tensors, model_for, randomize, rank_state, to_hf, to_mg

from mm_rl.config.loader import ConfigError
from mm_rl.convert.errors import ConversionError
from mm_rl.convert.layout import save_model_state
from mm_rl.demo.tiny import build_tiny_checkpoint
from mm_rl_cli.main import main

hf2mg_module = importlib.import_module("mm_rl.convert.hf2mg")  # the package attribute is the function
hf_writer_module = importlib.import_module("mm_rl.convert.hf_writer")

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    built = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "untied", seed=0)
    return randomize(built, tmp_path_factory.mktemp("hf") / "untied", seed=10, files=1)


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    """A TP2 x PP2 conversion that tests copy before damaging it."""
    return to_mg(tiny, tmp_path_factory.mktemp("mm") / "mm", 2, [2, 0], [1, 3])


def edited_copy(tiny, dst, edit):
    """A copy of the tiny checkpoint whose tensors went through ``edit(dict)``."""
    shutil.copytree(tiny, dst)
    tensors = hf_tensors(tiny)
    edit(tensors)
    (dst / "model-00001-of-00001.safetensors").unlink()
    (dst / "model.safetensors.index.json").unlink()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if ".partial." in p.name or ".old." in p.name)


# ----------------------------------------------------------------------------------------- config errors
@pytest.mark.parametrize(
    "vit, llm, message",
    [
        ([2, 0], [1, 2], "sum to model.text_decoder.num_layers = 4 (they sum to 3)"),
        ([2], [1, 3], "has 1 entries but llm_pp_layers has 2"),
        ([1, 1], [2, 2], "the ViT must end by stage 0"),
    ],
)
def test_pipeline_split_errors(tiny, tmp_path, vit, llm, message):
    model = model_for(tiny, [2], [4])
    with pytest.raises(ConfigError, match="cfg.parallel_config") as err:
        to_mg(tiny, tmp_path / "mm", 1, vit, llm, model=model)
    assert message in str(err.value)
    assert not (tmp_path / "mm").exists()


def test_tp_must_divide_query_groups(tiny, tmp_path):
    with pytest.raises(ConfigError, match=r"TP must divide model.text_decoder.num_query_groups = 2"):
        to_mg(tiny, tmp_path / "mm", 4, [2], [4])


def test_more_layers_than_the_checkpoint(tiny, tmp_path):
    with pytest.raises(ConfigError, match=r"model.text_decoder.num_layers = 6: the checkpoint .* has only 4"):
        to_mg(tiny, tmp_path / "mm", 1, [2], [6])


# --------------------------------------------------------------------------------------- HF side errors
def test_missing_hf_tensor(tiny, tmp_path):
    hf = edited_copy(tiny, tmp_path / "hf", lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(ConversionError, match=r"lacks tensors(.|\n)*model.layers.2.mlp.up_proj.weight"):
        to_mg(hf, tmp_path / "mm", 1, [2], [4])
    assert not (tmp_path / "mm" / "release").exists()


def test_unexpected_hf_tensor(tiny, tmp_path):
    rogue = {"model.layers.0.self_attn.rogue.weight": torch.ones(2)}
    hf = edited_copy(tiny, tmp_path / "hf", lambda t: t.update(rogue))
    with pytest.raises(ConversionError, match=r"model.layers.0.self_attn.rogue.weight \(in model.safetensors\)"):
        to_mg(hf, tmp_path / "mm", 1, [2], [4])


def test_untied_checkpoint_with_a_tied_model_json(tiny, tmp_path):
    model = model_for(tiny, [2], [4])
    model.text_decoder.untie_embeddings_and_output_weights = False
    with pytest.raises(ConversionError, match=r"does not use(.|\n)*lm_head.weight"):
        to_mg(tiny, tmp_path / "mm", 1, [2], [4], model=model)


def test_hf_shape_mismatch(tiny, tmp_path):
    def shrink(tensors):
        tensors["model.layers.3.self_attn.k_proj.bias"] = tensors["model.layers.3.self_attn.k_proj.bias"][:60]

    hf = edited_copy(tiny, tmp_path / "hf", shrink)
    with pytest.raises(
        ConversionError,
        match=r"model.layers.3.self_attn.k_proj.bias in model.safetensors: shape "
        r"\[60\], model.json gives \[64\]",
    ):
        to_mg(hf, tmp_path / "mm", 1, [2], [4])


def test_missing_hf_files(tiny, tmp_path):
    with pytest.raises(ConversionError, match="does not exist"):
        to_mg(tmp_path / "nowhere", tmp_path / "mm", 1, [2], [4], model=model_for(tiny, [2], [4]))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConversionError, match="no model.safetensors.index.json and no"):
        to_mg(empty, tmp_path / "mm", 1, [2], [4], model=model_for(tiny, [2], [4]))
    partial = tmp_path / "partial"
    shutil.copytree(tiny, partial)
    (partial / "model-00001-of-00001.safetensors").unlink()
    with pytest.raises(ConversionError, match=r"names files that are missing(.|\n)*model-00001-of-00001"):
        to_mg(partial, tmp_path / "mm", 1, [2], [4], model=model_for(tiny, [2], [4]))


def test_interrupted_hf2mg_leaves_the_previous_conversion(tiny, tmp_path, monkeypatch):
    mm_dir = to_mg(tiny, tmp_path / "mm", 1, [2, 0], [2, 2])
    before = rank_state(mm_dir, 0, 1, 2)["model"]
    calls = []

    def failing_save(path, state, zip_crc32):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk full")
        save_model_state(path, state, zip_crc32)

    monkeypatch.setattr(hf2mg_module, "save_model_state", failing_save)
    with pytest.raises(OSError, match="disk full"):
        to_mg(tiny, mm_dir, 2, [2, 0], [2, 2])
    assert sorted(p.name for p in mm_dir.iterdir()) == ["latest_checkpointed_iteration.txt", "release"]
    assert sorted(p.name for p in (mm_dir / "release").iterdir()) == [
        "hf2mg_source.json",
        "mp_rank_00_000",
        "mp_rank_00_001",
    ]
    assert all(torch.equal(before[k], v) for k, v in rank_state(mm_dir, 0, 1, 2)["model"].items())
    with pytest.raises(OSError, match="disk full"):  # and into a fresh directory: nothing at all
        calls.clear()
        to_mg(tiny, tmp_path / "fresh", 2, [2, 0], [2, 2])
    assert list((tmp_path / "fresh").iterdir()) == []


# ---------------------------------------------------------------------------------- Megatron side errors
def damaged(converted, tmp_path, edit=None):
    """A copy of the TP2 x PP2 conversion; ``edit(state)`` changes mp_rank_01_001's model dict."""
    root = tmp_path / "damaged"
    shutil.copytree(converted, root)
    if edit:
        path = root / "release" / "mp_rank_01_001" / "model_optim_rng.pt"
        state = torch.load(path, weights_only=True)
        edit(state["model"])
        torch.save(state, path)
    return root


def convert_back(tiny, root, tmp_path, tp=2, vit=(2, 0), llm=(1, 3), **kwargs):
    return to_hf(tiny, root, tmp_path / "out", tp, list(vit), list(llm), **kwargs)


def test_missing_rank_file(tiny, converted, tmp_path):
    root = damaged(converted, tmp_path)
    (root / "release" / "mp_rank_01_000" / "model_optim_rng.pt").unlink()
    with pytest.raises(ConversionError, match=r"mp_rank_01_000/model_optim_rng.pt is missing"):
        convert_back(tiny, root, tmp_path)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_other_parallel_layout(tiny, converted, tmp_path):
    with pytest.raises(
        ConversionError,
        match=r"holds rank directories of TP=2 x PP=2, the parallel config gives "
        r"TP=1 x PP=2",
    ):
        convert_back(tiny, converted, tmp_path, tp=1)


def test_unexpected_megatron_tensor(tiny, converted, tmp_path):
    root = damaged(converted, tmp_path, lambda s: s.update({"text_decoder.decoder.layers.3.mlp.extra": torch.ones(1)}))
    with pytest.raises(
        ConversionError,
        match=r"mp_rank_01_001/model_optim_rng.pt does not hold(.|\n)*unexpected "
        r"text_decoder.decoder.layers.3.mlp.extra",
    ):
        convert_back(tiny, root, tmp_path)


def test_missing_megatron_tensor(tiny, converted, tmp_path):
    root = damaged(converted, tmp_path, lambda s: s.pop("text_decoder.decoder.final_layernorm.weight"))
    with pytest.raises(ConversionError, match=r"mp_rank_01_001(.|\n)*missing text_decoder.decoder.final_layernorm"):
        convert_back(tiny, root, tmp_path)


def test_megatron_shape_mismatch(tiny, converted, tmp_path):
    key = "text_decoder.decoder.layers.1.mlp.linear_fc1.weight"
    root = damaged(converted, tmp_path, lambda s: s.update({key: s[key][:-2]}))
    with pytest.raises(
        ConversionError,
        match=r"mp_rank_01_001/model_optim_rng.pt: text_decoder.decoder.layers.1."
        r"mlp.linear_fc1.weight \(TP rank 1 of 2\) has shape \[254, 128\]",
    ):
        convert_back(tiny, root, tmp_path)


def test_half_written_rank_file(tiny, converted, tmp_path):
    root = damaged(converted, tmp_path)
    path = root / "release" / "mp_rank_00_001" / "model_optim_rng.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ConversionError, match=r"mp_rank_00_001/model_optim_rng.pt cannot be read .*half-written"):
        convert_back(tiny, root, tmp_path)


def test_missing_latest_file_or_iteration(tiny, converted, tmp_path):
    root = damaged(converted, tmp_path)
    (root / "latest_checkpointed_iteration.txt").unlink()
    with pytest.raises(ConversionError, match=r"latest_checkpointed_iteration.txt is missing.*interrupted"):
        convert_back(tiny, root, tmp_path)
    assert hf_tensors(convert_back(tiny, root, tmp_path, iteration="release"))  # an explicit iteration still works
    with pytest.raises(ConversionError, match=r"iter_0000009 does not exist \(iterations present .*\['release'\]\)"):
        convert_back(tiny, root, tmp_path, iteration=9)


def test_interrupted_mg2hf_leaves_nothing(tiny, converted, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hf_writer_module.ShardedWriter, "finish", fail)
    with pytest.raises(OSError, match="disk full"):
        convert_back(tiny, converted, tmp_path)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_refuses_to_overwrite_the_source_or_a_foreign_directory(tiny, converted, tmp_path):
    with pytest.raises(ConfigError, match="cfg.save_hf_dir .* is the source HuggingFace checkpoint"):
        to_hf(tiny, converted, tiny, 2, [2, 0], [1, 3])
    foreign = tmp_path / "out"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="exists and is not a HuggingFace checkpoint"):
        convert_back(tiny, converted, tmp_path)
    assert (foreign / "notes.txt").read_text() == "mine"


# ----------------------------------------------------------------------------------------------- CLI
def test_cli_flags_round_trip(tiny, tmp_path, capsys):
    layout = ["--cfg.parallel_config.tp_size", "2", "--cfg.parallel_config.llm_pp_layers", "[1,3]"]
    assert (
        main(["convert", "hf2mg", "--cfg.mm_dir", str(tmp_path / "mm"), "--cfg.hf_config.hf_dir", str(tiny), *layout])
        == 0
    )
    assert sorted(p.name for p in (tmp_path / "mm" / "release").iterdir())[-1] == "mp_rank_01_001"
    assert (
        main(
            [
                "convert",
                "mg2hf",
                "--cfg.load_dir",
                str(tmp_path / "mm"),
                "--cfg.save_hf_dir",
                str(tmp_path / "hf"),
                "--hf_dir",
                str(tiny),
                *layout,
                "--max_shard_size",
                "1MB",
            ]
        )
        == 0
    )
    assert f"wrote {tmp_path / 'hf'}" in capsys.readouterr().out
    out = hf_tensors(tmp_path / "hf")
    assert all(torch.equal(t, out[k]) for k, t in hf_tensors(tiny).items())
    assert (
        len(set(json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    )


def test_cli_job_round_trip(tiny, tmp_path, monkeypatch, capsys):
    from omegaconf import OmegaConf

    monkeypatch.chdir(tmp_path)
    job = {
        "af_output_dir": str(tmp_path / "out"),
        "backend_config": {
            "actor_config": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
            "megatron_training": {"tokenizer_name_or_path": str(tiny)},
            "model": model_for(tiny, [2, 0], [1, 3]).__dict__,
        },
    }
    OmegaConf.save(OmegaConf.create(job), tmp_path / "job.yaml")
    assert main(["convert", "hf2mg", "--job", "job.yaml"]) == 0
    assert (tmp_path / "out" / "converted_weight_TP2_PP2" / "release" / "mp_rank_01_001").is_dir()
    ckpt = tmp_path / "out" / "ckpt"  # a training checkpoint where the job saves them
    shutil.copytree(tmp_path / "out" / "converted_weight_TP2_PP2" / "release", ckpt / "iter_0000004")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    assert main(["convert", "mg2hf", "--job", "job.yaml"]) == 0
    out = hf_tensors(tmp_path / "out" / "ckpt_converted_mg2hf")
    assert all(torch.equal(t, out[k]) for k, t in hf_tensors(tiny).items())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["convert", "hf2mg", "--cfg.mm_dir", "x"], "--cfg.hf_config.hf_dir = None: is required"),
        (
            [
                "convert",
                "hf2mg",
                "--cfg.mm_dir",
                "x",
                "--cfg.hf_config.hf_dir",
                "TINY",
                "--cfg.paralel_config.tp_size",
                "2",
            ],
            "did you mean 'parallel_config'",
        ),
        (
            [
                "convert",
                "hf2mg",
                "--cfg.mm_dir",
                "x",
                "--cfg.hf_config.hf_dir",
                "TINY",
                "--cfg.parallel_config.tp_size",
                "4",
            ],
            "TP must divide model.text_decoder.num_query_groups = 2",
        ),
        (
            ["convert", "mg2hf", "--cfg.load_dir", "nowhere", "--cfg.save_hf_dir", "y", "--hf_dir", "TINY"],
            "checkpoint directory nowhere does not exist",
        ),
        (["convert", "hf2mg", "--job", "missing.yaml"], "file not found"),
        (["convert", "hf2mg", "--cfg.mm_dir", "x", "--epochs", "3"], "--epochs = '3': is not a convert option"),
        (
            [
                "convert",
                "mg2hf",
                "--cfg.load_dir",
                "x",
                "--cfg.save_hf_dir",
                "y",
                "--hf_dir",
                "TINY",
                "--iteration",
                "last",
            ],
            "must be 'release' or a step number",
        ),
    ],
)
def test_cli_errors_exit_1_without_traceback(tiny, tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main([str(tiny) if a == "TINY" else a for a in argv]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
