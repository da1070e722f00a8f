"""The tools (benches, demo, chaos) sit beside the library: ``kvwire``'s command line loads them by name,
and where they are absent it lists them and says how to get them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvwire
from kvwire import cli

TOOL_PATHS = [path for path, module, _help in cli.COMMANDS if module.startswith("kvwire_tools.")]


def test_every_tool_command_is_in_kvwire_tools_and_exists() -> None:
    assert {"demo", "chaos", "bench transfer", "bench overhead", "transport-demo"} <= set(TOOL_PATHS)
    for path, module, _help in cli.COMMANDS:
        assert cli._module_available(module), f"{path}: {module} not found"


def test_no_library_module_imports_the_tools() -> None:
    root = Path(kvwire.__file__).parent
    found = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] == "kvwire_tools"]
    assert found == []


def test_absent_tools_are_listed_and_say_the_fix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = cli._module_available
    monkeypatch.setattr(cli, "_module_available", lambda m: False if cli._is_tool(m) else real(m))
    assert cli.main(["bench", "transfer", "--json", "x.json"]) == 2
    err = capsys.readouterr().err
    assert "kvwire bench transfer" in err and "pip install -e '.[tools]'" in err
    assert cli.main(["demo"]) == 2
    assert "pip install -e '.[tools]'" in capsys.readouterr().err
    helptext = cli.build_parser([]).format_help()
    assert "demo" in helptext and "needs kvwire's tools" in helptext
    # The library's own commands are untouched.
    assert cli._missing_tool("serve router") is None and cli._missing_tool("sim") is None
