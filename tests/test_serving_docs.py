"""docs/serving.md's flag table is the parser's (tools/flag_table.py generates it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def flag_table():
    spec = importlib.util.spec_from_file_location("flag_table", REPO / "tools" / "flag_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_documented_serve_flags_are_the_parsers():
    tool = flag_table()
    documented = tool.documented("serve", REPO / "docs" / "serving.md")
    assert documented is not None, "docs/serving.md lost its <!-- flags:serve --> block"
    assert documented == tool.table("serve"), (
        "docs/serving.md's flag table differs from `ragblend serve --help`: run "
        "python tools/flag_table.py serve --write docs/serving.md"
    )


def test_every_serve_flag_has_a_row(tmp_path):
    tool = flag_table()
    table = tool.table("serve")
    for flag in ("--api-key KEY (repeatable)", "--api-key-file FILE", "--timeout SECONDS"):
        assert f"`{flag}`" in table
    doc = tmp_path / "doc.md"
    doc.write_text("before\n<!-- flags:serve -->\nstale\n<!-- /flags:serve -->\nafter\n")
    assert tool.main(["serve", "--write", str(doc)]) == 0
    assert doc.read_text() == f"before\n<!-- flags:serve -->\n{table}<!-- /flags:serve -->\nafter\n"
