from setuptools import find_packages, setup

setup(
    name="fastdeploy_r3",
    version="0.1.0",
    description="MoE LLM serving engine with Rollout Routing Replay (R3)",
    packages=find_packages(include=["fastdeploy_r3", "fastdeploy_r3.*"]),
    python_requires=">=3.10",
    install_requires=[
        # torch is installed by the Makefile (CPU build where there is no CUDA) and kept where present.
        "torch>=2.4",
        "numpy",
        "safetensors",
        "tokenizers",
        "xxhash",
        "tqdm",
        "pyzmq",
        "fastapi",
        "uvicorn",
        "prometheus-client",
        "redis",
        "jinja2",
    ],
    extras_require={
        "triton": ["triton"],
        # Mooncake Store (storage tier, R3 p2pstore): the CPU build; needs `apt-get install libibverbs1`.
        # Where there is a CUDA driver, install `mooncake-transfer-engine` (the CUDA build) instead.
        "mooncake": ["mooncake-transfer-engine-non-cuda==0.3.13.post1"],
        # R3 as Paddle tensors at the trainer boundary (CPU build; paddlepaddle-gpu on GPU trainers).
        "paddle": ["paddlepaddle==3.3.1"],
        "test": ["pytest", "pytest-timeout", "transformers>=5", "openai", "httpx", "ruff", "triton", "matplotlib"],
    },
    entry_points={"console_scripts": ["fastdeploy-r3=fastdeploy_r3.entrypoints.cli:main"]},
)
