"""Developer tools of the repository (tools/, not part of the installed package), loaded by
path: the repository root is never put on sys.path (its `kernels/` would shadow Hugging
Face's package of that name)."""
import importlib.util
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"specengine_tool_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
