"""Tensor-parallel inference: the group of processes one model is split across (group.py). The
worker processes that replay each step live with the runner (worker/tensor_parallel.py)."""
