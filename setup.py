"""Install torchrl_grpo: ``pip install -e .[test]`` (see the Makefile for the full set-up)."""

from setuptools import find_packages, setup

EXTRAS = {
    "test": ["pytest>=8", "hypothesis>=6"],
    "examples": ["tqdm", "matplotlib"],
    # the LLM example builds its tokenizer with tokenizers (a dependency of transformers too);
    # peft: LoRA models on LeanTransformersWrapper
    "llm": ["transformers>=5", "tokenizers", "peft"],
    "dist": ["ray[default]"],
    "docs": ["sphinx>=7.2", "furo"],
    # the examples' optional loggers (--logger tensorboard / wandb; csv needs nothing)
    "tensorboard": ["tensorboard"],
    "wandb": ["wandb"],
}
EXTRAS["dev"] = sorted({dep for deps in EXTRAS.values() for dep in deps} | {"ruff"})

setup(
    name="torchrl_grpo",
    version="0.1.0",
    description="Group Relative Policy Optimization for torchrl: a fast MCAdvantage and a GRPOLoss.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["torchrl_grpo", "torchrl_grpo.*"]),
    python_requires=">=3.11",
    install_requires=[
        # Install torch==2.13.0 first (the CPU wheel): an open range pulls a CUDA build.
        "torch>=2.11",
        "torchrl>=0.14.1,<0.15",
        "tensordict",
        "gymnasium",
    ],
    extras_require=EXTRAS,
    license="MIT",
)
