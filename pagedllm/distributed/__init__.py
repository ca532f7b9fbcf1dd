"""Tensor-parallel inference: the group of processes one model is split across, and its workers."""
