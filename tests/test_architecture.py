"""The house's shape, checked: imports run one way with no cycle (the contracts in .importlinter, by
import-linter), no source file grows past what one reader holds (a package by concern instead), and the drawing of
the house in docs/architecture.md places every module."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 700
SOURCES = ("llmgw", "cluster", "gateway", "dashboard", "agents", "ground", "bench", "tests")


def test_imports_keep_the_contracts(monkeypatch, capsys):
    from importlinter.cli import EXIT_STATUS_SUCCESS, lint_imports

    monkeypatch.chdir(ROOT)
    status = lint_imports(config_filename=str(ROOT / ".importlinter"), no_cache=True, no_logo=True)
    said = capsys.readouterr().out
    assert status == EXIT_STATUS_SUCCESS, said
    assert "0 broken" in said, said


def test_no_source_file_is_over_700_lines():
    long = {}
    for top in SOURCES:
        for path in (ROOT / top).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                long[str(path.relative_to(ROOT))] = lines
    assert not long, f"split these by concern into packages: {long}"


def layers_drawn() -> dict[str, set[str]]:
    """docs/architecture.md's table of the layers inside each app: app -> every module it names."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    table = doc.split("The layers inside each app", 1)[1].split("\n\n", 2)[1]
    return {m[0]: set(re.findall(r"`([\w.]+)`", m[1])) for m in re.findall(r"^\| `(\w+)` \| (.*) \|$", table, re.M)}


def modules(app: str) -> set[str]:
    """An app's modules and packages, but Django's app config."""
    return {p.stem if p.is_file() else p.name for p in (ROOT / app).iterdir()
            if (p.suffix == ".py" or (p.is_dir() and any(p.glob("*.py"))))
            and p.name not in ("__init__.py", "apps.py", "migrations", "__pycache__")}


def test_the_drawing_of_the_house_names_every_module_in_its_layer():
    drawn = layers_drawn()
    assert set(drawn) == {"cluster", "gateway", "agents", "ground", "dashboard", "llmgw"}
    missing = {app: sorted(modules(app) - names) for app, names in drawn.items() if modules(app) - names}
    assert not missing, f"place these in docs/architecture.md's table of layers (as in .importlinter): {missing}"
