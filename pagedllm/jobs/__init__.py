"""The training job service: `pagedllm serve`'s /v1/training and /v1/cluster routes.

store.py (SQLite behind a repository interface) · launcher.py (one torchrun process tree per job)
· monitor.py (the trainer's events file into the store) · slots.py (slots, FIFO queue)
· cluster.py (measured node status) · service.py (the component) · routes.py (REST).
"""
