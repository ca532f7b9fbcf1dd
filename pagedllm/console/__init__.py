"""The web console: a chat playground, model management, live engine metrics and training jobs in
one page served by `pagedllm serve` at `/` (static files, no build step; docs/console.md)."""
