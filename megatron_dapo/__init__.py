"""megatron-dapo: DAPO reinforcement learning on Megatron-Core."""

__version__ = "0.1.0"
