"""lightserve: an LLM serving system. The five component folders install as subpackages of `lightserve`."""
from setuptools import setup

COMPONENTS = ["router", "model_infer", "detokenizer", "shm", "kernels"]
# lightserve/'s own folders: the HTTP front, chat, and the engine seen from the launcher.
FRONT_FOLDERS = ["http", "chat", "engine"]

setup(
    name="lightserve",
    version="0.1.0",
    description="Multi-process LLM server with token-level KV cache, continuous batching and a radix prefix cache",
    python_requires=">=3.10",
    packages=["lightserve"] + [f"lightserve.{f}" for f in FRONT_FOLDERS] + [f"lightserve.{c}" for c in COMPONENTS]
    + ["lightserve.kernels.cpu", "lightserve.model_infer.models"],
    package_dir={"lightserve": "lightserve", **{f"lightserve.{c}": c for c in COMPONENTS},
                 "lightserve.kernels.cpu": "kernels/cpu", "lightserve.model_infer.models": "model_infer/models"},
    package_data={"lightserve.kernels.cpu": ["*.c", "*.h"]},  # built on first use (kernels/cpu/__init__.py)
    install_requires=[
        "torch>=2.4,<2.15",
        "triton>=3.0",
        "pyzmq>=25",
        "numpy>=1.24",
        "uvloop>=0.19",
        "transformers>=4.45",
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "safetensors>=0.4",
        "gguf>=0.10",
        "xgrammar>=0.2.9",  # structured output (model_infer/grammar.py); leaves torch 2.13 as is
        "prometheus-client>=0.20",
        "tqdm",
        "orjson>=3.8",
        "accelerate",  # transformers needs it to load the bundled GGUF
    ],
    extras_require={
        # sglang-router: the cache-aware load balancer the replica tests run lightserve behind (a
        # ~30 MB Rust wheel; its own deps are fastapi, uvicorn, aiohttp, orjson, setproctitle).
        # anthropic: the official client that tests/e2e/test_anthropic_api.py drives /v1/messages with.
        # peft: makes the LoRA tests' adapters and merges them into transformers' reference.
        "test": ["pytest>=8", "pytest-timeout", "hypothesis", "openai>=1.40", "anthropic>=2", "aiohttp>=3.9", "httpx",
                 "jsonschema", "sglang-router>=0.3.2,<0.4", "ruff>=0.6", "peft>=0.13"],  # ruff: `make lint` (ruff.toml)
    },
    entry_points={"console_scripts": ["lightserve-launch=lightserve.launch_server:main"]},
)
