from setuptools import find_packages, setup

setup(
    name="jaxrl_llm",
    version="0.1.0",
    description="Asynchronous RL post-training of language models in JAX/Flax",
    packages=find_packages(include=["jaxrl_llm", "jaxrl_llm.*"]),
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.7",  # jax.shard_map(check_vma=...); tested with 0.10.2
        "flax>=0.10",
        "optax>=0.2.3",
        "orbax-checkpoint>=0.6",
        "chex>=0.1.87",
        "ml-collections>=0.1.1",
        "numpy>=1.26",
        "transformers>=4.45",
        "datasets>=2.20",
        "safetensors>=0.4",
        "math-verify>=0.7",  # math-dataset rewards
        "tensorboardX>=2.6",  # TensorBoard event files
        "matplotlib>=3.7",  # jaxrl_llm.research.report
        "tqdm>=4.60",  # progress bar
        "pyarrow>=15",  # sampler nodes: Arrow Flight (remote/service.py)
        "crc32c>=2.4",  # sampler nodes: hardware CRC-32C of weight chunks (remote/wire.py)
        "fastapi>=0.110",  # the agent gateway's HTTP face (gateway/server.py)
        "uvicorn>=0.29",
        "openai>=1.40",  # task.name=agent: the stock client the agents are given (gateway/agents.py)
    ],
    extras_require={
        # JAX for an accelerator (docs/accelerators.md). On a GPU, install the test extra's torch from
        # its CPU index first: a CUDA torch brings CUDA libraries that may shadow JAX's own.
        "gpu": ["jax[cuda12]>=0.7"],
        "tpu": ["jax[tpu]>=0.7"],
        # CPU torch, used only for parity tests against HF transformers.
        "test": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "scipy>=1.10", "import-linter>=2.1",
                 "torch==2.13.0", "peft>=0.13", "wandb>=0.22", "mlflow-skinny>=3.0",
                 "openai-agents>=0.24"],  # an Agents SDK agent trained through the gateway (tests/test_gateway.py)
        # logging.backends=wandb / mlflow (run/tracking.py, docs/tracking.md)
        "tracking": ["wandb>=0.22", "mlflow-skinny>=3.0"],
        # experiments/bench_peer.py's peer (Hugging Face TRL's GRPOTrainer); not needed by the tests.
        "peer": ["trl>=1.0", "torch==2.13.0"],
    },
)
