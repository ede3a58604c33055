"""Build hook. The compiled KV-cache extension in csrc/ is optional: the package imports and
works without it (torch index ops are the fallback). Metadata lives in pyproject.toml."""
from setuptools import setup

setup()
