"""The import-cycle check that `make lint` runs (tools/import_cycles.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "import_cycles.py"


def _checker():
    spec = importlib.util.spec_from_file_location("import_cycles", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_finds_a_cycle_through_function_level_and_relative_imports(tmp_path):
    pkg = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from pkg.sub import b\n",
            "sub/__init__.py": "",
            "sub/b.py": "def f():\n    from ..c import g\n    return g\n",
            "c.py": "import pkg.a\ndef g():\n    return 1\n",
            "d.py": "from pkg.a import x\n",
        },
    )
    assert _checker().find_cycles(pkg) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]


def test_imports_under_type_checking_name_each_other_unless_runtime_only(tmp_path):
    pkg = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from pkg import b\n",
            "b.py": (
                "from typing import TYPE_CHECKING\n"
                "import typing\n"
                "if TYPE_CHECKING:\n    from pkg.a import A\n"
                "if typing.TYPE_CHECKING:\n    import pkg.a\n"
            ),
        },
    )
    assert _checker().find_cycles(pkg) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert _checker().find_cycles(pkg, type_checking=False) == []


def test_the_else_branch_of_type_checking_runs(tmp_path):
    pkg = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "import pkg.b\n",
            "b.py": "TYPE_CHECKING = False\nif TYPE_CHECKING:\n    pass\nelse:\n    import pkg.a\n",
        },
    )
    assert _checker().find_cycles(pkg) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_a_namespace_package_is_named_from_its_distribution_root(tmp_path):
    (tmp_path / "pyproject.toml").write_text("")
    ns = tmp_path / "ns" / "sub"
    ns.mkdir(parents=True)
    pkg = _package(
        ns,
        {"__init__.py": "", "a.py": "import ns.sub.pkg.b\n", "b.py": "from ns.sub.pkg import a\n"},
    )
    assert _checker().find_cycles(pkg) == [["ns.sub.pkg.a", "ns.sub.pkg.b", "ns.sub.pkg.a"]]


def test_command_fails_on_a_cycle_and_passes_on_ragblend_and_integrations(tmp_path):
    pkg = _package(
        tmp_path, {"__init__.py": "", "a.py": "import pkg.b\n", "b.py": "import pkg.a\n"}
    )
    bad = subprocess.run([sys.executable, str(SCRIPT), str(pkg)], capture_output=True, text=True)
    assert bad.returncode == 1
    assert "import cycle: pkg.a -> pkg.b -> pkg.a" in bad.stdout
    packages = [
        REPO / "ragblend",
        REPO / "integrations" / "langchain-ragblend" / "langchain_ragblend",
        REPO / "integrations" / "llama-index-llms-ragblend" / "llama_index" / "llms" / "ragblend",
    ]
    good = subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, packages)], capture_output=True, text=True
    )
    assert good.returncode == 0, good.stdout
