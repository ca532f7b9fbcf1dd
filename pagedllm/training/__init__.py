"""Distributed training on PyTorch's own engines (FSDP2, tensor/pipeline parallel, DCP); see docs/training.md."""
