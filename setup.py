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
        "test": ["pytest", "pytest-timeout", "transformers>=5", "openai", "httpx", "ruff", "triton"],
    },
    entry_points={"console_scripts": ["fastdeploy-r3=fastdeploy_r3.entrypoints.cli:main"]},
)
