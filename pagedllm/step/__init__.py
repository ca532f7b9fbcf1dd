"""One engine step: how it runs (planner.py, the one owner of the fast paths), what the scheduler
hands the model runner (scheduler_output.py) and what the runner hands back (runner_output.py).
The scheduler and the runner both import this package; it imports neither."""
