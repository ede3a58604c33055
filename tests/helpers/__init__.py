"""Test helpers, imported as `helpers.<module>` (tests/ is on the path via tests/conftest.py):
exact distributions and TV bounds, fake heads and drafters, launch counting, op backends,
repository tools, and the strict-skip plugin CI runs with."""
