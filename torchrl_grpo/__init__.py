"""torchrl_grpo: Group Relative Policy Optimization for torchrl."""

__version__ = "0.1.0"
