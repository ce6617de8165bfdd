from setuptools import find_packages, setup

setup(
    name="fastdeploy_r3",
    version="0.1.0",
    description="MoE LLM serving engine with Rollout Routing Replay (R3)",
    packages=find_packages(include=["fastdeploy_r3", "fastdeploy_r3.*"]),
    python_requires=">=3.10",
    # Runtime dependencies: `pip install fastdeploy_r3` alone serves a model. Lower bounds: the oldest
    # versions whose APIs are used; upper bounds: the next release past the versions the tests run
    # against (tighter for uvicorn, h11, fastapi and starlette: the server builds on their internals,
    # entrypoints/openai/connection_limits.py).
    install_requires=[
        # torch is installed by the Makefile (CPU build where there is no CUDA) and kept where present.
        "torch>=2.4,<2.14",
        "numpy>=1.26,<3",
        "safetensors>=0.4,<0.9",
        "tokenizers>=0.20,<0.24",
        "transformers>=5,<6",  # AutoTokenizer, chat templates, generation_config defaults
        "huggingface_hub>=0.34,<3",  # --model as a Hub id, through its cache (config/hub.py)
        "xxhash>=3.4,<5",
        "tqdm>=4.66,<5",
        "pyzmq>=26,<28",
        "fastapi>=0.115,<0.166",
        "starlette>=0.40,<1.11",
        "uvicorn>=0.30,<0.55",
        "h11>=0.14,<0.17",
        "pydantic>=2.7,<3",
        "prometheus-client>=0.20,<0.27",
        "redis>=5,<9",
        "jinja2>=3.1,<4",
        "httpx>=0.27,<0.29",  # the trainer-side client (client/) calls the server
    ],
    extras_require={
        "triton": ["triton"],
        # Mooncake Store (storage tier, R3 p2pstore): the CPU build; needs `apt-get install libibverbs1`.
        # Where there is a CUDA driver, install `mooncake-transfer-engine` (the CUDA build) instead.
        "mooncake": ["mooncake-transfer-engine-non-cuda==0.3.13.post1"],
        # R3 as Paddle tensors at the trainer boundary (CPU build; paddlepaddle-gpu on GPU trainers).
        "paddle": ["paddlepaddle==3.3.1"],
        # sglang-router: the registry's router in front of two servers (tests/entrypoints/test_sglang_router.py)
        # pytest-xdist: `make test` runs the files on TEST_WORKERS processes (most tests wait on servers)
        "test": ["pytest", "pytest-timeout", "pytest-xdist>=3.5,<4", "openai", "httpx", "ruff", "triton",
                 "matplotlib", "sglang-router==0.3.2"],
    },
    entry_points={"console_scripts": ["fastdeploy-r3=fastdeploy_r3.entrypoints.cli:main"]},
)
