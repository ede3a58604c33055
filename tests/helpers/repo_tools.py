"""Developer tools of the repository (tools/, not part of the installed package), loaded by
path: tools/ is no package of the install, and the checkout's root stays off sys.path."""
import importlib.util
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(name: str):
    module_name = f"specengine_tool_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, TOOLS / f"{name}.py")
        module = sys.modules[module_name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
        spec.loader.exec_module(module)
    return sys.modules[module_name]
