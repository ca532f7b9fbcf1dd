"""One engine step's contract: what the scheduler hands the model runner (scheduler_output.py)
and what the runner hands back (runner_output.py). Both sides import it; it imports neither."""
