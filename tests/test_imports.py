"""The package dependency rules (docs/architecture.md, "Package dependencies"), checked on the source.

Every module of buffer/, serving/, training/ and deploy/ is parsed with `ast`; every import counts, the
ones inside functions included (a function-local import is still a dependency):

- buffer imports none of our packages;
- serving imports buffer and its own modules only;
- training imports buffer, its own modules and serving's pure decoding and model-loading parts
  (serving/decoding/, serving/models.py);
- deploy may import all of them.

The diagram in docs/architecture.md must name exactly the package edges the code has.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("buffer", "serving", "training", "deploy")
TRAINING_MAY_USE = ("serving.decoding", "serving.models")     # serving's pure decoding and model loading


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in the file, at any depth; `from a import b` gives `a.b` when
    `a.b` is a module of ours, else `a`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:                                   # relative: resolve against the file's package
                base = list(path.relative_to(ROOT).with_suffix("").parts[:-node.level])
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                is_module = (ROOT / Path(*sub.split("."))).with_suffix(".py").is_file() \
                    or (ROOT / Path(*sub.split("."))).is_dir()
                out.append((node.lineno, sub if is_module else mod))
    return sorted(set(out))


def source_files(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


def edges() -> dict[str, set[str]]:
    """package -> the other packages of ours it imports."""
    out: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for pkg in PACKAGES:
        for path in source_files(pkg):
            for _, mod in imported_modules(path):
                top = mod.split(".")[0]
                if top in PACKAGES and top != pkg:
                    out[pkg].add(top)
    return out


def forbidden(pkg: str, mod: str) -> str | None:
    """Why `pkg` must not import `mod` (None: allowed)."""
    top = mod.split(".")[0]
    if top not in PACKAGES or top == pkg:
        return None
    if pkg == "buffer":
        return "buffer imports none of our packages"
    if pkg == "serving" and top != "buffer":
        return "serving imports buffer and its own modules only"
    if pkg == "training":
        if top == "buffer":
            return None
        if top == "serving" and any(mod == m or mod.startswith(m + ".") for m in TRAINING_MAY_USE):
            return None
        return "training imports buffer and serving's decoding/ and models.py only"
    return None


def violations() -> list[str]:
    out = []
    for pkg in PACKAGES:
        for path in source_files(pkg):
            for line, mod in imported_modules(path):
                why = forbidden(pkg, mod)
                if why:
                    out.append(f"{path.relative_to(ROOT)}:{line} imports {mod}: {why}")
    return out


def test_no_package_imports_one_it_must_not():
    assert violations() == []


@pytest.mark.parametrize("pkg, source, why", [
    ("buffer", "def f():\n    from serving.models import cache_dir\n", "buffer imports none"),
    ("serving", "import deploy.registry\n", "serving imports buffer"),
    ("serving", "def f():\n    from training import data\n", "serving imports buffer"),
    ("training", "def f():\n    from deploy.registry import Registry\n", "training imports buffer"),
    ("training", "from serving.service import Service\n", "training imports buffer"),
    ("training", "from serving import engine\n", "training imports buffer"),
])
def test_the_check_sees_a_forbidden_import_even_inside_a_function(tmp_path, monkeypatch, pkg, source, why):
    """The rule check itself: a planted module with a forbidden (function-local) import is reported."""
    fake_root = tmp_path / "repo"
    for p in PACKAGES:
        (fake_root / p).mkdir(parents=True)
    for p in ("serving/models.py", "serving/service.py", "serving/engine.py", "training/data.py",
              "deploy/registry.py"):
        (fake_root / p).write_text("")
    (fake_root / pkg / "planted.py").write_text(source)
    monkeypatch.setitem(globals(), "ROOT", fake_root)
    found = violations()
    assert len(found) == 1 and why in found[0] and found[0].startswith(f"{pkg}/planted.py:"), found


def test_allowed_imports_are_not_reported(tmp_path, monkeypatch):
    fake_root = tmp_path / "repo"
    for p in PACKAGES:
        (fake_root / p).mkdir(parents=True)
    (fake_root / "serving" / "decoding").mkdir()
    (fake_root / "serving" / "decoding" / "warp.py").write_text("")
    (fake_root / "serving" / "models.py").write_text("")
    (fake_root / "training" / "ok.py").write_text(
        "from buffer.redis_store import x\nfrom serving.decoding.warp import w\nfrom serving import models\n")
    (fake_root / "serving" / "ok.py").write_text("from buffer.paths import data_dir\nfrom serving import models\n")
    (fake_root / "deploy" / "ok.py").write_text("import training.job\nfrom serving.service import Service\n")
    monkeypatch.setitem(globals(), "ROOT", fake_root)
    assert violations() == []


def documented_edges() -> dict[str, set[str]]:
    """The edges of the diagram under "## Package dependencies" in docs/architecture.md: lines
    `<package> -> <package>, <package> ...` (anything in parentheses is a comment)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Package dependencies", 1)[1].split("\n## ", 1)[0]
    out: dict[str, set[str]] = {}
    for line in section.splitlines():
        m = re.match(r"^\s*(buffer|serving|training|deploy)\s+->\s*(.*)$", line)
        if m:
            targets = re.sub(r"\([^)]*\)", "", m.group(2))
            out[m.group(1)] = {t for t in re.findall(r"[a-z]+", targets) if t in PACKAGES}
    return out


def test_the_documented_diagram_matches_the_imports():
    assert documented_edges() == edges()


# Each outside system enters through its doors (docs/architecture.md): Redis through buffer/redis_store.py;
# MLflow only in deploy (the client is deploy/registry.py's; live_stats and distill_job log through it and
# import MLflow's entity classes only); Ray only where deploy builds the Serve app and runs jobs.
DOORS = {
    "redis": {"buffer/redis_store.py"},
    "mlflow": {"deploy/registry.py", "deploy/live_stats.py", "deploy/distill_job.py"},
    "ray": {"deploy/app.py", "deploy/ray_jobs.py", "deploy/distill_job.py"},
}


def test_outside_systems_enter_through_their_doors():
    found: dict[str, set[str]] = {system: set() for system in DOORS}
    for pkg in PACKAGES:
        for path in source_files(pkg):
            for _, mod in imported_modules(path):
                top = mod.split(".")[0]
                if top in found:
                    found[top].add(str(path.relative_to(ROOT)))
    assert found == DOORS
    # only the registry creates MLflow clients
    clients = {str(p.relative_to(ROOT)) for pkg in PACKAGES for p in source_files(pkg)
               if "MlflowClient(" in p.read_text()}
    assert clients == {"deploy/registry.py"}
