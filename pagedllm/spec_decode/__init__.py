"""Speculative decoding: proposers (a draft model, or n-gram prompt lookup), verification by
rejection sampling, and their configuration."""
