"""bench/ is a maintained suite, not an archive (docs/benchmarks.md): every script is run by a
`make` target (directly or as a sibling module a target's script imports), there are at most a
dozen, bench/README.md holds current tables only, and no test reaches into bench/."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
MAX_SCRIPTS = 12
MAX_README_LINES = 300


def _entry_text() -> str:
    return (ROOT / "Makefile").read_text() + "".join(p.read_text() for p in (ROOT / "scripts").glob("*.sh"))


def _sibling_imports(path: Path) -> set[str]:
    """Top-level modules of bench/ that a script imports (bench/ is its folder on sys.path)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_every_bench_script_is_run_by_a_make_target():
    entries = _entry_text()
    run = {p for p in BENCH.rglob("*.py") if str(p.relative_to(ROOT)) in entries}
    reached = set(run)
    for script in run:  # the modules a run script imports: bench/x.py as `x`, bench/peers/x.py as `peers.x`,
        for name in _sibling_imports(script):  # and a module of the script's own folder (bench/ops/x.py as `x`)
            for base in (BENCH, script.parent):
                module = base / (name.replace(".", "/") + ".py")
                if module.exists():
                    reached.add(module)
    conftests = set(BENCH.rglob("conftest.py"))
    orphans = sorted(str(p.relative_to(ROOT)) for p in set(BENCH.rglob("*.py")) - reached - conftests)
    assert not orphans, f"bench/ files no make target runs or imports: {orphans}"


def test_bench_stays_a_small_suite():
    scripts = sorted(p.name for p in BENCH.glob("*.py"))
    assert len(scripts) <= MAX_SCRIPTS, scripts
    assert not list(BENCH.glob("*.cpp")), "a C++ probe is an experiment: its conclusion goes to docs/design.md"
    lines = len((BENCH / "README.md").read_text().splitlines())
    assert lines <= MAX_README_LINES, f"bench/README.md has {lines} lines: current tables only"


def test_no_test_imports_from_bench():
    pattern = re.compile(r"sys\.path\.insert\([^)]*bench|^\s*(from|import)\s+bench\b", re.M)
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py")
                 if p != Path(__file__).resolve() and pattern.search(p.read_text())]
    assert not offenders, offenders


def test_every_bench_target_writes_to_one_named_file():
    """`make -n` of every bench target: each `--out` names one path ending in .json (a make variable
    whose line ends in a comment keeps the spaces before it, and split `--out x_avx2 .json` in two)."""
    import subprocess

    targets = re.findall(r"^(bench[\w-]*):", (ROOT / "Makefile").read_text(), re.M)
    assert "bench-gguf" in targets
    dry = subprocess.run(["make", "-n", "-s", *targets], cwd=ROOT, capture_output=True, text=True, timeout=120)
    outs = re.findall(r"--out\s+(\S+)(\s+\S+)?", dry.stdout)
    assert len(outs) >= 8, dry.stdout[-2000:] + dry.stderr[-2000:]
    bad = [(path, nxt) for path, nxt in outs if not re.fullmatch(r"bench/results/[\w.-]+\.json", path)
           or nxt.strip().startswith(".json")]
    assert not bad, bad
