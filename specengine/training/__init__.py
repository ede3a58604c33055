"""Offline training of the drafting artifacts: the acceptance head (head.py) and the parallel drafter (parallel.py)."""
