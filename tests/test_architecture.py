"""The house's shape, checked: imports run one way with no cycle (the contracts in .importlinter, by
import-linter), and no source file grows past what one reader holds (a package by concern instead)."""

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
