"""``make soak``: memory of a serving process through faults (see run.py)."""
