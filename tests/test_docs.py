"""docs/architecture.md must stay true: every source file of the project has its line there, and
every file it lists exists."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("serving", "buffer", "training", "deploy", "scripts", "tests")


def _project_files() -> set[str]:
    out = set()
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*"):
            if p.is_file() and p.suffix in (".py", ".yaml") and p.name != "__init__.py" \
                    and "__pycache__" not in p.parts:
                out.add(p.relative_to(ROOT).as_posix())
    return out


def test_architecture_lists_every_file_and_only_existing_ones():
    text = (ROOT / "docs" / "architecture.md").read_text()
    listed = set(re.findall(r"^- `([\w./-]+\.(?:py|yaml))`", text, flags=re.M))
    missing = sorted(_project_files() - listed)
    stale = sorted(f for f in listed if not (ROOT / f).exists())
    assert not missing, f"docs/architecture.md has no line for: {missing}"
    assert not stale, f"docs/architecture.md lists files that do not exist: {stale}"
