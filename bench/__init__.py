"""`make bench`: pp_worker's speed and memory side by side with one tinygrad process (see bench/run.py)."""
