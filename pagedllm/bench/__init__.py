"""Benchmarks run from the CLI (`pagedllm bench <name>`), always against a baseline measured in
the same run, because this machine is shared and noisy."""
