"""The package installs editable and as a wheel, its kernels as `specengine.kernels` (never a bare
`kernels`: Hugging Face's package of that name, which transformers >= 5.25 imports, must stay theirs)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


CHECK = ("import specengine, specengine.kernels as k, importlib.util as u; "
         "print(specengine.__file__); print(k.__file__); s = u.find_spec('kernels'); print(s and s.origin)")


def test_editable_install_maps_kernels_under_specengine(tmp_path):
    # a neutral cwd: `python -m pytest` puts the repo root on sys.path, an installed user would not
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, cwd=tmp_path,
                         check=True).stdout.splitlines()
    assert Path(out[0]).resolve() == ROOT / "specengine" / "__init__.py"
    assert Path(out[1]).resolve() == ROOT / "specengine" / "kernels" / "__init__.py"
    assert out[2] == "None" or "site-packages" in out[2]  # the bare name: free, or Hugging Face's package


def test_the_checkouts_root_shadows_no_package():
    """Run from the checkout (`python -m specengine.demo` in `make demo`, Ray's workers), its root is on
    sys.path: no top-level folder there may be importable under a name a dependency imports."""
    shadows = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()} - {"specengine"}
    assert not shadows, f"top-level packages in the checkout would shadow namesakes: {sorted(shadows)}"


@pytest.mark.slow
def test_wheel_install_imports(tmp_path):
    """A wheel built with the extension off: no package-discovery warnings, it carries every
    kernel and every subpackage's files (heads and drafters included), and it imports (the
    model included) from site-packages."""
    import zipfile

    wheels, site = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    env = {**os.environ, "SPECENGINE_BUILD_EXT": "0"}  # the package must import without the extension
    build = subprocess.run([*pip, "wheel", "-v", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
                           check=True, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert "would be ignored" not in build.stdout + build.stderr
    wheel = next(wheels.glob("specengine-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    folders = [d for d in (ROOT / "specengine").rglob("*") if d.is_dir() and d.name != "__pycache__"]
    assert {"layers", "models", "runtime", "methods", "drafting", "heads", "drafters"} <= {d.name for d in folders}
    for src, dst in [(d, d.relative_to(ROOT).as_posix()) for d in folders]:
        files = [f for f in src.iterdir() if f.suffix in (".py", ".json", ".safetensors")]
        assert files and all(f"{dst}/{f.name}" in names for f in files), (dst, sorted(names))
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True)
    check = CHECK + "; import specengine.models.decoder, specengine.serve"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=tmp_path, check=True,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}).stdout.splitlines()
    assert out[0].startswith(str(site)) and out[1] == str(site / "specengine" / "kernels" / "__init__.py")
    assert out[2] == "None" or "site-packages" in out[2]  # Hugging Face's, never ours
