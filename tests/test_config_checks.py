"""`check` catches what needs only the yaml, the data files and the HF checkpoint's files: one bad case (rejected
with its key and a fix) and one good case per rule, on the tiny job with fake, fast inputs (no model is built)."""

import base64
import json

import pytest
from job_inputs import write_data_dir, write_hf_dir, write_rows

from mm_rl.config.loader import load_job
from mm_rl.config.schema import BasicDataParameters
from mm_rl.data.dataset import count_usable_rows, find_split
from mm_rl.job.create import ClusterSpec, create_job, write_job
from mm_rl.job.validate import validate
from mm_rl_cli.main import main

B = "backend_config"
MT, RL, TRAIN, ACTOR = f"{B}.megatron_training", f"{B}.rl_config", f"{B}.training", f"{B}.actor_config"
GEN, SAMPLING, VAL = (
    f"{B}.generate_config",
    f"{B}.generate_config.sampling_config",
    f"{B}.generate_config.val_sampling_config",
)
DATA = f"{B}.data.dataset_param.basic_parameters"
TEXT = f"{B}.model.text_decoder"
HF_DIR = f"{B}.convert_ckpt_hf2mg.cfg.hf_config.hf_dir"
PROCESSOR_DIR = f"{B}.data.dataset_param.preprocess_parameters.model_name_or_path"
TP, PP = f"{ACTOR}.tensor_model_parallel_size", f"{ACTOR}.pipeline_model_parallel_size"


@pytest.fixture(scope="module")
def tiny_yaml(tmp_path_factory):
    """The job `ascendfactory-cli config --af_model_name tiny` writes (without building its model and data)."""
    node, _, plan = create_job("tiny", "tiny_checks", ClusterSpec())
    return write_job(node, plan, tmp_path_factory.mktemp("tiny_job") / "job.yaml", "tiny")


@pytest.fixture()
def check(tiny_yaml, tmp_path):
    """``validate`` of the tiny job with overrides; its outputs, checkpoint (tiny_hf) and data set are in tmp_path."""
    write_hf_dir(tmp_path / "tiny_hf", {"text_config": {"max_position_embeddings": 4096, "vocab_size": 1024}})
    write_data_dir(tmp_path / "geo3k_synthetic")

    def run(*overrides):
        return validate(load_job(tiny_yaml, [f"af_output_dir={tmp_path}", *overrides]))

    return run


def rejected(problems, key):
    """The one violation, on ``key``, with a rule and a fix."""
    assert [p.key for p in problems] == [key], problems
    (problem,) = problems
    assert problem.rule and problem.fix
    return problem


def test_the_tiny_job_with_its_inputs_passes(check):
    assert check() == []


# ------------------------------------------------------------------------------------------------ mini-batch
def test_mini_batch_larger_than_a_step_is_rejected(check):
    problem = rejected(check(f"{RL}.mini_batch_size=128"), f"{RL}.mini_batch_size")  # 8 prompts x 8 samples = 64
    assert "64 samples per step" in problem.rule and "no optimizer step" in problem.rule
    assert "use 64" in problem.fix and f"{RL}.rollout_batch_size to a multiple of 16" in problem.fix
    problem = rejected(check(f"{MT}.global_batch_size=128"), f"{MT}.global_batch_size")  # the key it follows
    assert "use 64" in problem.fix


def test_the_gbs_fix_also_fills_whole_mini_batches(check):
    """MBS 2 with 3 prompts x 4 samples = 12 per step: GBS 7 is not a multiple of 2, and of the nearest multiples 6 and
    8 only 6 divides the step (the mini-batch follows GBS): the fix proposes 6 or 12, each of which passes."""
    step = (f"{ACTOR}.micro_batch_size=2", f"{RL}.rollout_batch_size=3", f"{RL}.n_samples_per_prompt=4")
    problems = check(*step, f"{MT}.global_batch_size=7")
    multiple = next(p for p in problems if "multiple of MBS x DP" in p.rule)
    assert multiple.fix == "use 6 or 12"
    for gbs in (6, 12):
        assert check(*step, f"{MT}.global_batch_size={gbs}") == []


def test_mini_batch_that_divides_the_step_is_accepted(check):
    assert check(f"{RL}.mini_batch_size=64") == []
    assert check(f"{MT}.global_batch_size=16") == []


def test_cli_check_reports_it_without_a_traceback(tiny_yaml, tmp_path, capsys):
    write_hf_dir(tmp_path / "tiny_hf")
    write_data_dir(tmp_path / "geo3k_synthetic")
    assert main(["check", str(tiny_yaml), f"--af_output_dir={tmp_path}", f"--{MT}.global_batch_size=128"]) == 1
    err = capsys.readouterr().err
    assert "error: 1 problem(s)" in err and f"{MT}.global_batch_size = 128" in err and "Traceback" not in err
    assert "no optimizer step" in err


# ------------------------------------------------------------------------------------------------- sampling
def test_greedy_sampling_with_a_group_is_rejected(check):
    problem = rejected(check(f"{SAMPLING}.temperature=0"), f"{SAMPLING}.temperature")
    assert "zero advantages" in problem.rule and "1.0" in problem.fix


def test_sampling_temperature_and_greedy_validation_are_accepted(check):
    assert check(f"{SAMPLING}.temperature=0.7", f"{VAL}.temperature=0") == []


@pytest.mark.parametrize(
    ("override", "key"),
    [
        (f"{SAMPLING}.top_p=0", f"{SAMPLING}.top_p"),
        (f"{SAMPLING}.top_p=1.5", f"{SAMPLING}.top_p"),
        (f"{SAMPLING}.top_k=-2", f"{SAMPLING}.top_k"),
        (f"{VAL}.top_p=0", f"{VAL}.top_p"),
        (f"{VAL}.top_k=-5", f"{VAL}.top_k"),
    ],
)
def test_top_p_and_top_k_outside_what_the_engine_takes_are_rejected(check, override, key):
    assert "(off)" in rejected(check(override), key).fix


@pytest.mark.parametrize(
    "overrides",
    [
        [f"{SAMPLING}.top_k=0", f"{VAL}.top_k=-1"],  # both mean off, in vLLM as in the HF engine
        [f"{SAMPLING}.top_k=50", f"{SAMPLING}.top_p=0.9", f"{VAL}.top_p=1.0"],
    ],
)
def test_valid_top_p_and_top_k_are_accepted(check, overrides):
    assert check(*overrides) == []


@pytest.mark.parametrize(
    ("override", "key", "rule"),
    [
        (f"{RL}.reward.num_workers=0", f"{RL}.reward.num_workers", "at least 1"),
        (f"{GEN}.max_num_seqs=0", f"{GEN}.max_num_seqs", "at least 1"),
        (f"{RL}.dynamic_sampling.max_num_gen_batches=0", f"{RL}.dynamic_sampling.max_num_gen_batches", "at least 1"),
        (f"{TRAIN}.seed=-1", f"{TRAIN}.seed", "2^32 - 1"),
        (f"{TRAIN}.seed=4294967296", f"{TRAIN}.seed", "2^32 - 1"),
        (f"{RL}.val_freq=-1", f"{RL}.val_freq", "0 (off)"),
        (f"{RL}.gamma=2", f"{RL}.gamma", "(0, 1]"),
        (f"{RL}.gamma=0", f"{RL}.gamma", "(0, 1]"),
        (f"{SAMPLING}.logprobs=-1", f"{SAMPLING}.logprobs", "0 or a count"),
        ("env.RAY_CONNECT_TIMEOUT_S=0", "env.RAY_CONNECT_TIMEOUT_S", "positive"),
        ("env.DEVICE_MEMORY_RESERVE_GB=30", "env.DEVICE_MEMORY_RESERVE_GB", "[0, the device memory)"),
        ("env.DEVICE_MEMORY_GB=0", "env.DEVICE_MEMORY_GB", "positive"),
    ],
)
def test_values_no_run_can_use_are_rejected_with_their_key(check, override, key, rule):
    assert rule in rejected(check(override), key).rule


def test_model_json_changes_the_engine_cannot_follow_are_refused(check):
    """The engine builds the job's model.json (fewer layers, another rope), but vLLM's Qwen MLP runs silu only and
    no Qwen decoder in transformers or vLLM has LayerNorm: those changes are refused with the reason; the
    transformers engine takes any activation."""
    problem = rejected(check(f"{TEXT}.activation_func=gelu"), f"{TEXT}.activation_func")
    assert "silu only" in problem.rule and f"{GEN}.backend: hf" in problem.fix
    assert check(f"{TEXT}.activation_func=gelu", f"{GEN}.backend=hf") == []
    assert "'RMSNorm'" in rejected(check(f"{TEXT}.normalization=LayerNorm"), f"{TEXT}.normalization").rule
    assert check(f"{TEXT}.rope_theta=500000.0") == []


def test_a_narrower_llm_is_accepted_and_a_wider_one_refused(check):
    """model.json may cut the LLM narrower than its checkpoint (hf2mg, the engine and mg2hf cut the weights alike:
    tests/test_model_parity.py), regroup its KV heads or turn GQA off; it may not widen it, change the head size,
    or break the head size the engine derives from hidden_size / num_attention_heads."""
    proj = f"{B}.model.image_encoder.vision_projector.hidden_size"
    narrow = [f"{TEXT}.hidden_size=96", f"{TEXT}.num_attention_heads=3", f"{TEXT}.ffn_hidden_size=192", f"{proj}=96"]
    assert check(*narrow, f"{TEXT}.num_query_groups=1") == []
    assert check(*narrow, f"{TEXT}.num_query_groups=3") == []
    assert check(f"{TEXT}.group_query_attention=false") == []
    assert "never wider" in rejected(check(f"{TEXT}.ffn_hidden_size=512"), f"{TEXT}.ffn_hidden_size").rule
    problem = rejected(check(*narrow[:1], narrow[3], f"{TEXT}.num_query_groups=1"), f"{TEXT}.num_attention_heads")
    assert "set num_attention_heads to 3" in problem.fix
    problems = check(*narrow, f"{TEXT}.num_query_groups=1", f"{TEXT}.kv_channels=16")  # mrope_section breaks too
    (problem,) = [p for p in problems if p.key == f"{TEXT}.kv_channels"]
    assert "heads keep the checkpoint's size (32)" in problem.rule


def test_the_edges_of_those_ranges_are_accepted(check):
    edges = [f"{TRAIN}.seed=4294967295", f"{RL}.gamma=1", f"{RL}.val_freq=0", f"{SAMPLING}.logprobs=2"]
    assert check(*edges, f"{RL}.reward.num_workers=2", "env.RAY_CONNECT_TIMEOUT_S=0.5") == []
    assert check(f"{TRAIN}.seed=0") == []


# ------------------------------------------------------------------------------------------- optimisation
def test_non_positive_lr_is_reported_on_lr(check):
    problem = rejected(check(f"{ACTOR}.lr=-1e-6"), f"{ACTOR}.lr")
    assert "must be > 0" in problem.rule and "1e-6" in problem.fix
    rejected(check(f"{ACTOR}.lr=0"), f"{ACTOR}.lr")


def test_positive_lr_is_accepted(check):
    assert check(f"{ACTOR}.lr=1e-4") == []


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ([f"{RL}.kl_loss_coef=-0.1"], f"{RL}.kl_loss_coef"),
        ([f"{RL}.kl_ctrl.kl_coef=-0.001"], f"{RL}.kl_ctrl.kl_coef"),
        ([f"{RL}.kl_ctrl.type=adaptive", f"{RL}.kl_ctrl.target_kl=0"], f"{RL}.kl_ctrl.target_kl"),
        ([f"{RL}.kl_ctrl.type=adaptive", f"{RL}.kl_ctrl.horizon=0"], f"{RL}.kl_ctrl.horizon"),
        ([f"{TRAIN}.clip-grad=-1"], f"{TRAIN}.clip-grad"),
    ],
)
def test_negative_kl_weights_and_clip_grad_are_rejected(check, overrides, key):
    rejected(check(*overrides), key)


def test_zero_kl_weight_and_no_clipping_are_accepted(check):
    assert check(f"{RL}.kl_loss_coef=0", f"{TRAIN}.clip-grad=0", f"{RL}.kl_ctrl.type=adaptive") == []


def test_negative_max_keep_ckpts_is_rejected(check):
    assert "keep all" in rejected(check(f"{MT}.max_keep_ckpts=-1"), f"{MT}.max_keep_ckpts").fix


def test_max_keep_ckpts_zero_keeps_all_and_is_accepted(check):
    assert check(f"{MT}.max_keep_ckpts=0") == []


def test_negative_generations_per_step_is_rejected(check):
    assert "log none" in rejected(check("logger.generations_per_step=-1"), "logger.generations_per_step").fix


def test_generations_per_step_zero_or_more_is_accepted(check):
    assert check("logger.generations_per_step=0") == [] and check("logger.generations_per_step=4") == []


# ---------------------------------------------------------------------------------------------- positions
def test_seq_length_beyond_the_model_positions_is_rejected(check):
    problem = rejected(check(f"{TRAIN}.seq-length=8192"), f"{TRAIN}.seq-length")  # tiny model.json: 4096
    assert "4096" in problem.rule and "at most 4096" in problem.fix


def test_model_json_positions_beyond_the_checkpoint_are_rejected(check, tmp_path):
    write_hf_dir(tmp_path / "tiny_hf", {"text_config": {"max_position_embeddings": 256}})
    assert "at most 256" in rejected(check(), f"{TEXT}.max_position_embeddings").fix


def test_seq_length_within_the_positions_is_accepted(check):
    assert check(f"{TRAIN}.seq-length=4096") == []


# ------------------------------------------------------------------------------------------- HF checkpoint
@pytest.mark.parametrize(
    ("missing", "key", "named"),
    [
        ("config.json", HF_DIR, "config.json"),
        ("model.safetensors", HF_DIR, "*.safetensors"),
        ("tokenizer.json", PROCESSOR_DIR, "tokenizer"),
        ("chat_template.jinja", PROCESSOR_DIR, "chat template"),
    ],
)
def test_checkpoint_without_its_files_is_rejected(check, tmp_path, missing, key, named):
    (tmp_path / "tiny_hf" / missing).unlink()
    problem = rejected(check(), key)
    assert named in problem.rule and f"{MT}.tokenizer_name_or_path" in problem.fix


def test_chat_template_in_tokenizer_config_is_accepted(check, tmp_path):
    (tmp_path / "tiny_hf" / "chat_template.jinja").unlink()
    (tmp_path / "tiny_hf" / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert check() == []


def test_missing_checkpoint_dir_is_reported_once(check, tmp_path):
    problem = rejected(check(f"{MT}.tokenizer_name_or_path={tmp_path / 'nowhere'}"), HF_DIR)
    assert "does not exist" in problem.rule
    problem = rejected(
        check(f"{PROCESSOR_DIR}={tmp_path / 'nowhere'}", f"{HF_DIR}={tmp_path / 'tiny_hf'}"), PROCESSOR_DIR
    )  # set apart from hf_dir, which otherwise follows it
    assert "does not exist" in problem.rule


# --------------------------------------------------------------------------------------------------- reward
@pytest.mark.parametrize("function", ["no_such_reward_module:score", "mm_rl.rewards.geo3k:no_such_function"])
def test_reward_function_that_does_not_import_is_rejected(check, function):
    problem = rejected(check(f"{RL}.reward.function={function}"), f"{RL}.reward.function")
    assert "cannot be loaded" in problem.rule and "mm_rl.rewards.geo3k:compute_score" in problem.fix


def test_importable_reward_function_is_accepted(check):
    assert check(f"{RL}.reward.function=mm_rl.rewards.geo3k:format_reward") == []


# ----------------------------------------------------------------------------------------------------- data
def test_missing_train_split_is_rejected(check, tmp_path):
    (tmp_path / "geo3k_synthetic" / "train.jsonl").unlink()
    problem = rejected(check(), f"{DATA}.train_split")
    assert "looked for" in problem.rule and "train.jsonl" in problem.fix


def test_missing_validation_split_is_rejected_when_validation_is_on(check, tmp_path):
    (tmp_path / "geo3k_synthetic" / "test.jsonl").unlink()
    assert "val_freq: 0" in rejected(check(), f"{DATA}.val_split").fix  # the tiny job validates (step 0, every 10)


def test_missing_validation_split_is_accepted_when_validation_is_off(check, tmp_path):
    (tmp_path / "geo3k_synthetic" / "test.jsonl").unlink()
    assert check(f"{RL}.val_freq=0", f"{RL}.val_before_train=false") == []


def test_empty_split_file_is_rejected(check, tmp_path):
    (tmp_path / "geo3k_synthetic" / "train.jsonl").write_text("")
    assert "holds no rows" in rejected(check(), f"{DATA}.dataset_dir").rule


def test_a_dataset_dir_that_is_a_file_is_rejected(check, tmp_path):
    problem = rejected(
        check(f"{DATA}.dataset_dir={tmp_path / 'geo3k_synthetic' / 'train.jsonl'}"), f"{DATA}.dataset_dir"
    )
    assert "is a file, not a dataset directory" in problem.rule and "the directory that holds it" in problem.fix


def _image_rows(path, image: bytes, rows: int = 64) -> None:
    encoded = base64.b64encode(image).decode()
    row = {"prompt": "<image>What is x?", "answer": "1", "images": [encoded]}
    path.write_text("".join(json.dumps(row) + "\n" for _ in range(rows)))


def test_data_whose_images_do_not_decode_is_rejected_and_good_images_pass(check, tmp_path):
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (56, 56), (200, 30, 30)).save(buffer, format="PNG")
    _image_rows(tmp_path / "geo3k_synthetic" / "train.jsonl", buffer.getvalue()[:60])  # truncated PNGs
    problem = rejected(check(), f"{DATA}.dataset_dir")
    assert "none of the first 16 images of its rows decodes" in problem.rule
    _image_rows(tmp_path / "geo3k_synthetic" / "train.jsonl", buffer.getvalue())
    assert check() == []


def test_corrupt_split_file_is_rejected(check, tmp_path):
    (tmp_path / "geo3k_synthetic" / "train.parquet").write_bytes(b"not parquet")  # parquet wins over jsonl
    assert "cannot read" in rejected(check(), f"{DATA}.dataset_dir").rule


def test_rows_without_the_answer_field_are_rejected(check, tmp_path):
    write_rows(tmp_path / "geo3k_synthetic" / "train.jsonl", 64, answer_key="solution")
    problem = rejected(check(), f"{DATA}.answer_key")
    assert "missing field 'reward_model.ground_truth'" in problem.rule and "'solution'" in problem.fix


def test_rows_that_lack_the_answer_under_the_right_column_blame_the_rows_not_the_key(check, tmp_path):
    rows = [{"prompt": f"{i} + 1 = ?", "reward_model": {"style": "rule"}} for i in range(64)]
    (tmp_path / "geo3k_synthetic" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    problem = rejected(check(), f"{DATA}.dataset_dir")
    assert "missing field 'reward_model.ground_truth'" in problem.rule
    assert "the rows have the column 'reward_model'" in problem.fix and "fill it" in problem.fix


def test_rows_with_the_configured_answer_field_are_accepted(check, tmp_path):
    for split in ("train", "test"):  # the key names the column of both splits
        write_rows(tmp_path / "geo3k_synthetic" / f"{split}.jsonl", 64, answer_key="solution")
    assert check(f"{DATA}.answer_key=solution") == []


def test_fewer_rows_than_a_rollout_batch_are_rejected(check, tmp_path):
    write_rows(tmp_path / "geo3k_synthetic" / "train.jsonl", 5)  # the tiny job draws 8 prompts a step
    problem = rejected(check(), f"{RL}.rollout_batch_size")
    assert "only 5 usable rows" in problem.rule and "<= 5" in problem.fix


def test_a_split_that_fills_the_rollout_batch_is_accepted(check, tmp_path):
    write_rows(tmp_path / "geo3k_synthetic" / "train.jsonl", 5)
    assert check(f"{RL}.rollout_batch_size=4") == []  # 4 x 8 samples: still one GBS of 32


def test_verl_parquet_data_set_is_accepted(check, tmp_path):
    from mm_rl.demo.synthetic import write_synthetic_geo3k

    data = write_synthetic_geo3k(tmp_path / "verl", train_size=16, test_size=2)
    assert check(f"{DATA}.dataset_dir={data}") == []


def test_row_count_reads_only_what_it_needs_and_decodes_no_image(tmp_path):
    """On a real data set `check` must stay fast: rows after the ones needed are not read (the bad line is never
    met) and images are not decoded (the files are not images at all)."""
    for i in range(8):
        (tmp_path / f"{i}.png").write_bytes(b"not an image")
    lines = [json.dumps({"prompt": "<image>x?", "answer": "1", "images": [f"{i}.png"]}) for i in range(8)]
    (tmp_path / "train.jsonl").write_text("\n".join([*lines, "{broken"]) + "\n")
    files, basic = find_split(tmp_path, "train"), BasicDataParameters(dataset_dir=str(tmp_path))
    stats = count_usable_rows(files, basic, "", enough=8)
    assert (stats.kept, stats.rows, sum(stats.bad.values())) == (8, 8, 0)
    stats = count_usable_rows(files, basic, "", enough=9)
    assert (stats.kept, stats.rows, dict(stats.bad)) == (8, 9, {"invalid json line": 1})


# --------------------------------------------------------------------------------------------- checkpoints
def test_save_dir_that_cannot_be_written_is_rejected(check, tmp_path):
    (tmp_path / "afile").write_text("")
    assert "writable" in rejected(check(f"{MT}.save={tmp_path / 'afile' / 'ckpt'}"), f"{MT}.save").rule


def test_unwritable_output_dir_is_reported_once_for_the_paths_under_it(check, tmp_path):
    (tmp_path / "afile").write_text("")
    inputs = [
        f"{MT}.tokenizer_name_or_path={tmp_path / 'tiny_hf'}",
        f"{DATA}.dataset_dir={tmp_path / 'geo3k_synthetic'}",
    ]
    rejected(check(*inputs, f"af_output_dir={tmp_path / 'afile' / 'out'}"), "af_output_dir")  # not save, mm_dir...


def test_writable_save_dir_is_accepted(check, tmp_path):
    assert check(f"{MT}.save={tmp_path / 'new' / 'ckpt'}") == []


def test_resume_path_that_does_not_exist_is_rejected(check, tmp_path):
    problem = rejected(check(f"{MT}.resume_mode={tmp_path / 'ckpt' / 'iter_0000007'}"), f"{MT}.resume_mode")
    assert "auto" in problem.fix and "disable" in problem.fix
    rejected(check(f"{MT}.resume_mode={tmp_path}"), f"{MT}.resume_mode")  # exists, but is no checkpoint


def test_resume_modes_auto_and_disable_are_accepted(check):
    assert check(f"{MT}.resume_mode=auto") == [] and check(f"{MT}.resume_mode=disable") == []


def save_checkpoint(save_dir, step, tp):
    from mm_rl.checkpoint import CheckpointManager

    return CheckpointManager(save_dir, 0).save(step, {(t, 0): {"model": {}} for t in range(tp)}, {"sampler": {}})


def test_resume_from_another_layout_is_rejected_before_anything_starts(check, tmp_path):
    path = save_checkpoint(tmp_path / "ckpt", 3, tp=2)  # the tiny job's save dir; it runs TP 1
    for mode in ("auto", str(path)):
        problem = rejected(check(f"{MT}.resume_mode={mode}"), TP)
        assert "TP 2 x PP 1" in problem.rule and "this job: TP 1 x PP 1" in problem.rule
        assert f"{TP}: 2" in problem.fix and "resume_mode: disable" in problem.fix


def test_resume_from_the_same_layout_or_disabled_is_accepted(check, tmp_path):
    save_checkpoint(tmp_path / "ckpt", 3, tp=2)
    assert check(f"{MT}.resume_mode=disable") == []
    path = save_checkpoint(tmp_path / "same", 3, tp=1)
    assert check(f"{MT}.save={tmp_path / 'same'}") == []
    assert check(f"{MT}.save={tmp_path / 'same'}", f"{MT}.resume_mode={path}") == []


# ------------------------------------------------------------------------------------------- token budgets
@pytest.mark.parametrize("name", ["max_tokens_per_micro_batch", "log_prob_max_tokens_per_micro_batch"])
def test_token_budget_below_the_longest_sample_is_rejected(check, name):
    problem = rejected(check(f"{ACTOR}.{name}=300"), f"{ACTOR}.{name}")
    assert "256 + 64 = 320" in problem.rule and "at least 320" in problem.fix  # tiny: prompts 256, responses 64


def test_token_budgets_that_hold_the_longest_sample_are_accepted_and_free_gbs_from_mbs(check):
    budgets = (f"{ACTOR}.max_tokens_per_micro_batch=640", f"{ACTOR}.log_prob_max_tokens_per_micro_batch=2560")
    assert check(*budgets) == []
    assert (
        check(*budgets, f"{MT}.global_batch_size=12", f"{RL}.rollout_batch_size=3", f"{RL}.n_samples_per_prompt=4")
        == []
    )  # not a multiple of MBS 8
    assert (
        check(f"{MT}.global_batch_size=12", f"{RL}.rollout_batch_size=3", f"{RL}.n_samples_per_prompt=4") != []
    )  # without a budget it must be


@pytest.fixture(scope="module")
def qwen3_5_yaml(tmp_path_factory):
    """The job `config --af_model_name tiny_qwen3_5` writes (without building its model and data)."""
    node, _, plan = create_job("tiny_qwen3_5", "tiny_checks", ClusterSpec())
    return write_job(node, plan, tmp_path_factory.mktemp("qwen3_5_job") / "job.yaml", "tiny_qwen3_5")


@pytest.mark.parametrize(
    ("override", "key", "words"),
    [
        (f"{TRAIN}.context-parallel-size=2", f"{TRAIN}.context-parallel-size", "recurrent state"),
        (f"{ACTOR}.remove_padding=false", f"{ACTOR}.remove_padding", "packed sequences"),
        (f"{GEN}.dtype=float32", f"{GEN}.dtype", "bfloat16 only"),
        (f"{TEXT}.linear_num_value_heads=3", f"{TEXT}.linear_num_value_heads", "multiple of linear_num_key_heads"),
    ],
)
def test_what_gated_deltanet_layers_cannot_run_is_rejected(qwen3_5_yaml, tmp_path, override, key, words):
    write_hf_dir(tmp_path / "tiny_hf", model="tiny_qwen3_5")
    write_data_dir(tmp_path / "geo3k_synthetic")
    load = lambda *o: validate(load_job(qwen3_5_yaml, [f"af_output_dir={tmp_path}", *o]))  # noqa: E731
    assert load() == []
    problems = [p for p in load(override) if p.key == key]
    assert problems and words in problems[0].rule and problems[0].fix


LORA = f"{ACTOR}.lora"


@pytest.mark.parametrize(
    "overrides, key",
    [
        ([f"{LORA}.rank=-1"], f"{LORA}.rank"),
        ([f"{LORA}.rank=8", f"{LORA}.alpha=0"], f"{LORA}.alpha"),
        ([f"{LORA}.rank=8", f"{LORA}.dropout=1.0"], f"{LORA}.dropout"),
        ([f"{LORA}.rank=8", f"{LORA}.target_modules=[q_proj]"], f"{LORA}.target_modules"),
        ([f"{LORA}.rank=8", f"{LORA}.target_modules=[in_proj]"], f"{LORA}.target_modules"),  # no Gated DeltaNet
        ([f"{LORA}.rank=8", f"{LORA}.experts=true"], f"{LORA}.experts"),  # a dense model
        ([f"{LORA}.rank=8", f"{ACTOR}.unfreeze_vision_encoder=true"], f"{ACTOR}.unfreeze_vision_encoder"),
    ],
)
def test_lora_settings_no_run_can_use_are_rejected(check, overrides, key):
    rejected(check(*overrides), key)


def test_lora_settings_are_accepted(check):
    assert (
        check(f"{LORA}.rank=8", f"{LORA}.dropout=0.05", f"{LORA}.vision=true", f"{LORA}.target_modules=[linear_qkv]")
        == []
    )


TURNS = f"{RL}.multi_turn"


@pytest.mark.parametrize(
    "overrides, key",
    [
        ([f"{TURNS}.max_turns=0"], f"{TURNS}.max_turns"),
        ([f"{TURNS}.tool_timeout=0"], f"{TURNS}.tool_timeout"),
        ([f"{TURNS}.max_tool_images=-1"], f"{TURNS}.max_tool_images"),
        ([f"{TURNS}.tool_call_reward=-0.1"], f"{TURNS}.tool_call_reward"),
        ([f"{TURNS}.tools=[]"], f"{TURNS}.tools"),
        ([f"{TURNS}.tools=[python]"], f"{TURNS}.tools"),
        ([f"{TURNS}.tools=[no_such_module:TOOL]"], f"{TURNS}.tools"),
        ([f"{TURNS}.chat_template=missing.jinja"], f"{TURNS}.chat_template"),
        ([f"{TURNS}.max_tokens=4000"], f"{TRAIN}.seq-length"),  # the actor's sequences hold prompt + trajectory
    ],
)
def test_multi_turn_settings_no_run_can_use_are_rejected(check, overrides, key):
    rejected(check(f"{TURNS}.enable=true", f"{TURNS}.max_tokens=64", *overrides), key)


def test_multi_turn_settings_are_accepted_and_ignored_while_off(check, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for tool in tools %}{{ tool }}{% endfor %}")
    ok = (f"{TURNS}.enable=true", f"{TURNS}.max_tokens=64", f"{TURNS}.tools=[calculator,crop_image]")
    assert check(*ok) == [] and check(*ok, f"{TURNS}.chat_template=compact_tools") == []
    assert check(*ok, f"{TURNS}.chat_template={template}") == []
    assert check(f"{TURNS}.tools=[python]") == []  # off: nothing to load
    template.write_text("{{ messages }}")
    rejected(check(*ok, f"{TURNS}.chat_template={template}"), f"{TURNS}.chat_template")


PRE = f"{B}.data.dataset_param.preprocess_parameters"


@pytest.mark.parametrize(
    "overrides, key",
    [
        ([f"{PRE}.fps=0"], f"{PRE}.fps"),
        ([f"{PRE}.min_frames=0"], f"{PRE}.min_frames"),
        ([f"{PRE}.min_frames=40", f"{PRE}.max_frames=32"], f"{PRE}.min_frames"),
        ([f"{PRE}.video_min_pixels=10000", f"{PRE}.video_max_pixels=5000"], f"{PRE}.video_min_pixels"),
        ([f"{GEN}.max_videos_per_prompt=-1"], f"{GEN}.max_videos_per_prompt"),
        ([f"{GEN}.max_videos_per_prompt=1", f"{GEN}.backend=hf"], f"{GEN}.backend"),
        ([f"{GEN}.max_videos_per_prompt=1", f"{RL}.multi_turn.enable=true", f"{RL}.multi_turn.max_tokens=64"],
         f"{RL}.multi_turn.enable"),
    ],
)  # fmt: skip
def test_video_settings_no_run_can_use_are_rejected(check, overrides, key):
    rejected(check(*overrides), key)


def test_video_data_needs_room_in_the_engine_and_videos_that_decode(check, tmp_path):
    """Rows with two videos need max_videos_per_prompt 2; videos none of which decodes are named before the run."""
    data = tmp_path / "geo3k_synthetic"
    (data / "clip.mp4").write_bytes(b"\x00" * 32)
    rows = [{"prompt": "<video><video>Find x.", "videos": ["clip.mp4", "clip.mp4"], "answer": "1"}] * 64
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))  # the test split: text
    problems = check(f"{GEN}.max_videos_per_prompt=1")
    assert sorted(p.key for p in problems) == [f"{DATA}.dataset_dir", f"{GEN}.max_videos_per_prompt"]
    room = next(p for p in problems if p.key == f"{GEN}.max_videos_per_prompt")
    assert "up to 2 video" in room.rule and room.fix == "set it to 2"
    problem = rejected(check(f"{GEN}.max_videos_per_prompt=2"), f"{DATA}.dataset_dir")
    assert "videos of its rows decodes" in problem.rule
