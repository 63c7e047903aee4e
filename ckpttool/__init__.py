"""ckpttool: plan-then-stream conversion and sharding of large MoE checkpoints."""

__version__ = "0.1.0"
