"""The package follows its layers (docs/design.md, "Layers"): imports run only downward, there
are no import circles, methods never reach the runtime or the Engine, every Triton kernel
has its torch reference in its own file, and modules and functions stay small. Read from the
source with `ast`, lazy (function-level) imports included."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# floor of each top-level part, lowest first; a module imports only from its floor or below
FLOORS = {
    "errors": 0, "timing": 0, "eos": 0,
    "kernels": 1, "_kvext": 1, "_quantext": 1,  # the compiled extensions (csrc/, setup.py)
    "machine": 1,  # the CPU at hand, its cache dir and its one measurement table
    "huge_pages": 1,  # where the CPU weights sit in memory (2 MiB pages)
    "layers": 2,
    "models": 3,
    "runtime": 4, "drafting": 4, "structured": 4,  # structured: constraints, xgrammar matchers
    "methods": 5,
    "config": 6, "precision": 6, "draft_requant": 6, "planner": 6, "pair": 6, "request": 6, "counters": 6, "generation": 6, "detokenize": 6, "encoding": 6, "row_state": 6, "api": 6, "": 6,  # "": the package root
    "serve": 7, "training": 7,
    "cli": 8, "demo": 8, "benchmark": 8, "prompts": 8, "replay": 8,  # replay: benchmarks only
}
METHODS_MAY_IMPORT = {"errors", "timing", "kernels", "methods"}  # the context brings everything else


def modules() -> dict[str, Path]:
    """specengine module name -> file."""
    out = {}
    for f in (ROOT / "specengine").rglob("*.py"):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    out["specengine._kvext"] = out["specengine._quantext"] = ROOT / "setup.py"  # compiled: import nothing of ours
    return out


def imports(name: str, path: Path, known: dict) -> set[str]:
    """The specengine modules `name` imports (module-level and lazy)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    if path.suffix != ".py" or path.name == "setup.py":
        return found
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("specengine")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("specengine"):
                target = node.module
            else:
                continue
            subs = {f"{target}.{a.name}" for a in node.names} & known.keys()
            found |= subs or {target}
    return {m for m in found if m in known and m != name}


def part(module: str) -> str:
    return "" if module == "specengine" else module.split(".")[1]


@pytest.fixture(scope="module")
def graph():
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_every_part_has_a_floor(graph):
    assert {part(m) for m in graph} <= FLOORS.keys(), sorted({part(m) for m in graph} - FLOORS.keys())


def test_imports_run_downward_only(graph):
    up = [(m, t) for m, targets in graph.items() for t in targets if FLOORS[part(t)] > FLOORS[part(m)]]
    assert not up, up


def test_no_import_circles(graph):
    """Tarjan's strongly connected components: every one must be a single module."""
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v), on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                circles.append(sorted(scc))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_methods_reach_neither_the_runtime_nor_the_engine(graph):
    bad = [(m, t) for m, targets in graph.items() if part(m) == "methods" for t in targets
           if part(t) not in METHODS_MAY_IMPORT]
    assert not bad, bad
    for name, path in modules().items():
        if part(name) == "methods":
            assert "engine." not in path.read_text(), name  # no `self.engine.x` / `engine.x` calls


def test_no_method_imports_another(graph):
    methods = {"specengine.methods." + m for m in ("ar", "sd", "pearl", "parallelspec", "ngram")}  # ngram holds hybrid
    assert not [(m, t) for m in methods for t in graph[m] if t in methods]


def test_modules_and_functions_stay_small():
    """No module over 400 lines; a function over 60 lines says why in its docstring ("Why long:")."""
    long = []
    for name, path in modules().items():
        if path.name == "setup.py":
            continue
        src = path.read_text()
        assert len(src.splitlines()) <= 400, (name, len(src.splitlines()))
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                if "Why long:" not in (ast.get_docstring(node) or ""):
                    long.append((name, node.name, node.end_lineno - node.lineno + 1))
    assert not long, long


def test_every_folder_says_what_lives_there():
    for init in (ROOT / "specengine").rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, init


def _functions(path: Path) -> list[ast.FunctionDef]:
    return [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)]


def _triton_kernels(fns) -> list[str]:
    """The Triton kernels among a file's functions: `@triton.jit` (or autotuned) and named `_<name>_kernel`."""
    return [f.name for f in fns
            if f.name.endswith("_kernel") and any("triton." in ast.unparse(d) for d in f.decorator_list)]


def test_every_kernel_has_its_reference_in_its_own_file():
    """Liger's discipline: a file of kernels/ that defines a Triton kernel (a `@triton.jit`
    function named `_<name>_kernel`) also defines the torch reference it is tested against
    (`<op>_ref`), and the ops table names a reference and a kernel of one module per op."""
    from specengine.kernels.ops import OPS

    orphans, with_kernels = [], set()
    for path in sorted((ROOT / "specengine" / "kernels").glob("*.py")):
        fns = _functions(path)
        kernels = _triton_kernels(fns)
        if kernels:
            with_kernels.add(path.stem)
            if not any(f.name.endswith("_ref") for f in fns):
                orphans.append((path.name, kernels))
    assert not orphans, orphans
    assert len(with_kernels) >= 7, with_kernels  # the check sees the kernels it is about
    for op, (module, ref, kernel) in OPS.items():
        names = {f.name for f in _functions(Path(module.__file__))}
        assert {ref, kernel} <= names, (op, module.__name__)


def test_every_triton_kernel_is_tested_under_the_devices_triton():
    """`make gpu-rehearsal` runs the tests marked `triton` under the GPU machine's own Triton:
    a kernel module none of them imports would meet that Triton first on the GPU."""
    marked = [p for p in (ROOT / "tests").rglob("test_*.py")
              if re.search(r"^pytestmark = pytest\.mark\.triton\b", p.read_text(), re.M)]
    imported = {node.module.rsplit(".", 1)[-1] for p in marked for node in ast.walk(ast.parse(p.read_text()))
                if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {p.stem.removeprefix("test_") for p in marked}  # a test named after its kernel's module
    untested = [path.stem for path in sorted((ROOT / "specengine" / "kernels").glob("*.py"))
                if _triton_kernels(_functions(path)) and path.stem not in imported]
    assert not untested, untested
    assert len(marked) >= 7, marked  # the check sees the tests it is about
