"""Config errors that tell the whole story: every problem at once, followers that cannot drift from their source,
`config` refusing what it cannot write or run, and fixes that are right when followed."""

import os
from pathlib import Path

import pytest

from mm_rl.config.loader import ConfigError, load_checked, load_job
from mm_rl.job.validate import validate
from mm_rl_cli.main import main

TEXT = "backend_config.model.text_decoder"
ACTOR = "backend_config.actor_config"
TRAIN = "backend_config.training"
MT = "backend_config.megatron_training"
RL = "backend_config.rl_config"
GEN = "backend_config.generate_config"
TP = f"{ACTOR}.tensor_model_parallel_size"
GBS = f"{MT}.global_batch_size"


def rules(job):
    return validate(job, check_paths=False)


def problems(yaml_text=None, *overrides, tmp_path=None):
    """Every violation ``check`` would report (paths aside), or [] when the job is accepted."""
    path = None
    if yaml_text is not None:
        path = tmp_path / "job.yaml"
        path.write_text(yaml_text)
    try:
        load_checked(path, [f"--{o}" for o in overrides], rules)
    except ConfigError as err:
        return err.violations
    return []


def by_key(found):
    out = {}
    for v in found:
        out.setdefault(v.key, []).append(v)
    return out


# ------------------------------------------------------------------------------------------ all at once
FIVE_MISTAKES = """
env: {NPROC_PER_NODE: 4}
backend_config:
  actor_config: {micro_batch_sise: 2, min_lr: 1.0e-3}
  training: {seq-length: long, lr-warmup-fraction: 1.5}
  model:
    text_decoder: {mrope_section: [16, 16, 16]}
"""


def test_a_typo_and_a_type_error_do_not_hide_the_rules(tmp_path):
    found = problems(FIVE_MISTAKES, tmp_path=tmp_path)
    assert [(v.key, v.rule) for v in found[:2]] == [
        (f"{ACTOR}.micro_batch_sise", "unknown key"),
        (f"{TRAIN}.seq-length", "expected an integer"),
    ]
    assert {v.key for v in found[2:]} == {f"{ACTOR}.min_lr", f"{TRAIN}.lr-warmup-fraction", f"{TEXT}.mrope_section"}
    assert len(found) == 5 and all(v.fix for v in found)


def test_check_prints_all_five_without_a_traceback(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(FIVE_MISTAKES)
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    for key in ("micro_batch_sise", "seq-length", "min_lr", "lr-warmup-fraction", "mrope_section"):
        assert key in err
    assert "Traceback" not in err


def test_a_rule_that_would_judge_a_broken_value_is_left_out(tmp_path):
    # 3 prompts x 8 samples = 24: GBS 16 (the default standing in for the broken value) would not divide them.
    typed = problems(
        "backend_config:\n  megatron_training: {global_batch_size: sixteen}\n",
        f"{RL}.rollout_batch_size=3",
        tmp_path=tmp_path,
    )
    assert [(v.key, v.rule) for v in typed] == [(GBS, "expected an integer")]
    misspelt = problems(None, f"{MT}.global_batch_sise=24", f"{RL}.rollout_batch_size=3")
    assert [(v.key, v.rule) for v in misspelt] == [(f"{MT}.global_batch_sise", "unknown key")]
    # the same default judged where the user did not touch GBS is reported
    assert GBS in by_key(problems(None, f"{RL}.rollout_batch_size=3"))


def test_load_job_keeps_reporting_only_what_loading_finds(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(FIVE_MISTAKES)
    with pytest.raises(ConfigError) as err:
        load_job(path)
    assert [v.key for v in err.value.violations] == [f"{ACTOR}.micro_batch_sise"]


# -------------------------------------------------------------------------------------------- followers
@pytest.mark.parametrize(
    ("follower", "value", "source"),
    [
        (f"{RL}.mini_batch_size", 8, GBS),
        (f"{GEN}.sampling_config.n", 4, f"{RL}.n_samples_per_prompt"),
        (f"{TRAIN}.lr", 3e-6, f"{ACTOR}.lr"),
        # hf_dir follows model_name_or_path, which follows the checkpoint path: the fix names where it is set
        ("backend_config.convert_ckpt_hf2mg.cfg.hf_config.hf_dir", "/other", f"{MT}.tokenizer_name_or_path"),
    ],
)
def test_a_changed_follower_is_rejected_naming_its_source(follower, value, source, tmp_path):
    from_override = by_key(problems(None, f"{follower}={value}"))
    section, _, leaf = follower.rpartition(".")
    yaml = ""
    for depth, part in enumerate(section.split(".")):
        yaml += "  " * depth + f"{part}:\n"
    yaml += "  " * (section.count(".") + 1) + f"{leaf}: {value}\n"
    from_yaml = by_key(problems(yaml, tmp_path=tmp_path))
    for found in (from_override, from_yaml):
        assert list(found) == [follower]
        (violation,) = found[follower]
        assert source in violation.rule and f"set {source} instead" in violation.fix


def test_a_follower_equal_to_its_source_or_a_derived_path_is_accepted():
    assert problems(None, f"{RL}.mini_batch_size=16", f"{GEN}.sampling_config.n=8", f"{TRAIN}.lr=1e-6") == []
    assert problems(None, f"{MT}.save=/elsewhere/ckpt") == []  # ${af_output_dir}/ckpt is a default, not a repeat
    assert problems(None, f"{MT}.global_batch_size=32", f"{RL}.mini_batch_size=32") == []


def test_config_rejects_a_changed_follower(tmp_path, capsys):
    out = tmp_path / "job.yaml"
    assert main(["config", "--af_model_name", "tiny", "--output_file_path", str(out), f"--{RL}.mini_batch_size=3"]) == 1
    err = capsys.readouterr().err
    assert f"{RL}.mini_batch_size = 3" in err and f"set {GBS} instead" in err
    assert not out.exists()


# ------------------------------------------------------------------------------------- config's flags
@pytest.mark.parametrize(
    ("flag", "value"), [("--nnodes", "0"), ("--nnodes", "-1"), ("--nproc_per_node", "0"), ("--device_memory_gb", "0")]
)
def test_config_rejects_a_cluster_without_devices(flag, value, tmp_path, capsys):
    out = tmp_path / "job.yaml"
    assert main(["config", "--af_model_name", "qwen2_5_vl_3b", "--output_file_path", str(out), flag, value]) == 1
    err = capsys.readouterr().err
    assert f"{flag} = {float(value) if 'gb' in flag else int(value)}:" in err and "Fix:" in err
    assert "Traceback" not in err and not out.exists()


def test_config_names_an_output_path_it_cannot_write(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    assert (
        main(["config", "--af_model_name", "qwen2_5_vl_3b", "--output_file_path", str(tmp_path / "afile" / "job.yaml")])
        == 1
    )
    err = capsys.readouterr().err
    assert "--output_file_path" in err and f"{tmp_path / 'afile'} is a file, not a directory" in err
    assert main(["config", "--af_model_name", "qwen2_5_vl_3b", "--output_file_path", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "it is a directory" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_config_refuses_a_plan_beyond_the_device_memory(tmp_path, capsys):
    out = tmp_path / "job.yaml"
    argv = ["config", "--af_model_name", "qwen2_5_vl_72b", "--nnodes", "1", "--output_file_path", str(out)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "--nnodes = 1: the plan's memory estimate is" in err and "more than a device's 64 GiB" in err
    assert "--nnodes 4 is estimated to fit" in err and "--allow-oversubscribe" in err
    assert not out.exists()
    assert main([*argv, "--allow-oversubscribe"]) == 0
    assert "WARNING" in capsys.readouterr().out and out.exists()
    assert main(["config", "--af_model_name", "qwen2_5_vl_72b", "--nnodes", "8", "--output_file_path", str(out)]) == 0


# ------------------------------------------------------------------------------------ misleading fixes
def test_tp_advice_is_one_list_that_every_divisibility_rule_accepts():
    (violation,) = by_key(problems(None, "env.NPROC_PER_NODE=3", f"{TP}=3"))[TP]
    # heads 28, groups 4, ffn 18944, ViT heads 16 and ffn 3420, vocab 152064: only these divide all of them
    assert violation.fix.endswith("one of [1, 2, 4]")
    for tp in (1, 2, 4):
        assert problems(None, f"env.NPROC_PER_NODE={tp}", f"{TP}={tp}") == []
    cp = by_key(problems(None, "env.NPROC_PER_NODE=6", f"{TP}=3", f"{TRAIN}.context-parallel-size=2"))[TP]
    assert cp[0].fix.endswith("one of [1, 2]")  # Ulysses: CP x TP must divide the 28 heads too


def test_wrong_query_groups_are_not_turned_into_tp_advice():
    found = by_key(problems(None, f"{TEXT}.num_query_groups=5", "env.NPROC_PER_NODE=2", f"{TP}=2"))
    assert list(found) == [f"{TEXT}.num_query_groups"]  # TP 2 divides everything else
    assert found[f"{TEXT}.num_query_groups"][0].fix.endswith("one of [2, 4, 14, 28]")
    assert problems(None, f"{TEXT}.num_query_groups=14", "env.NPROC_PER_NODE=2", f"{TP}=2") == []
    (tp,) = by_key(problems(None, f"{TEXT}.num_query_groups=5", "env.NPROC_PER_NODE=3", f"{TP}=3"))[TP]
    assert "5" not in tp.rule and "[1, 2, 4]" in tp.fix and "num_query_groups is left out" in tp.fix


def test_gbs_advice_waits_for_a_whole_dp():
    def gbs_multiple(*overrides):
        return [v for v in problems(None, *overrides) if v.key == GBS and "multiple of MBS x DP" in v.rule]

    world = ("env.NPROC_PER_NODE=3", f"{TP}=2", f"{ACTOR}.micro_batch_size=2")
    (gbs,) = gbs_multiple(*world, f"{GBS}=5")
    assert "3 / 2 is not a positive whole number" in gbs.rule and gbs.fix.startswith("fix the device count")
    assert gbs_multiple(*world, f"{GBS}=16") == []  # a multiple of MBS: nothing to say yet
    (gbs,) = gbs_multiple("env.NPROC_PER_NODE=4", f"{GBS}=2")
    assert gbs.fix == "use 4"  # not "use 4 or 4"


def test_vocab_padding_advice():
    # make-vocab-size-divisible-by is 1: only TP can be wrong, and tp_divides says so
    found = by_key(
        problems(None, f"{TEXT}.vocab_size=152065", "env.NPROC_PER_NODE=2", f"{TP}=2", f"{TEXT}.num_query_groups=4")
    )
    assert list(found) == [TP] and f"{TEXT}.vocab_size = 152065" in found[TP][0].rule
    (pad,) = by_key(problems(None, f"{TRAIN}.make-vocab-size-divisible-by=1000"))[
        f"{TRAIN}.make-vocab-size-divisible-by"
    ]
    assert pad.fix == "use a divisor of vocab / TP = 152064, e.g. 864"
    assert problems(None, f"{TRAIN}.make-vocab-size-divisible-by=864") == []


def test_relative_paths_say_where_they_are_read_from(tmp_path, capsys):
    (tmp_path / "job.yaml").write_text(
        "backend_config:\n  data:\n    dataset_param:\n      basic_parameters:\n        dataset_dir: no_such_data\n"
    )
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert main(["check", "job.yaml"]) == 1
        err = capsys.readouterr().err
        assert f"dataset directory does not exist (relative to the current working directory, {tmp_path})" in err
        assert main(["check", "missing.yaml"]) == 1
        assert f"file not found (relative to the current working directory, {tmp_path})" in capsys.readouterr().err
        assert main(["check", str(tmp_path / "missing.yaml")]) == 1
        assert "relative to" not in capsys.readouterr().err
    finally:
        os.chdir(cwd)


def test_a_missing_checkpoint_is_fixed_where_its_path_is_set():
    found = validate(load_job(None, [f"--{MT}.tokenizer_name_or_path={Path('/no/such/ckpt')}"]))
    (hf,) = [v for v in found if v.key.endswith("hf_config.hf_dir")]
    assert hf.fix.startswith(f"point {MT}.tokenizer_name_or_path at")
