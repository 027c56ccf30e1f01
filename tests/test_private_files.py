"""Owner-only files: whatever the umask, ragblend's directories are 0700 and its files 0600."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CHUNKS, QUESTION, tiny_model

from ragblend import BlendConfig, BlendEngine
from ragblend.cli import main
from ragblend.controller import LoadingController
from ragblend.private import private_dir
from ragblend.store import DiskStore

ROOT = Path(__file__).resolve().parents[1]


def modes_under(root: Path) -> dict[str, str]:
    """``{path relative to root: octal mode}`` of ``root`` and every entry under it."""
    found = {".": oct(stat.S_IMODE(root.stat().st_mode))}
    for path in root.rglob("*"):
        found[str(path.relative_to(root))] = oct(stat.S_IMODE(path.lstat().st_mode))
    return found


def assert_private(root: Path) -> dict[str, str]:
    """Every directory under ``root`` (itself included) is 0700 and every file 0600."""
    modes = modes_under(root)
    wrong = {
        name: mode
        for name, mode in modes.items()
        if mode != ("0o700" if (root / name).is_dir() else "0o600")
    }
    assert wrong == {}, f"not owner-only under {root}: {wrong}"
    return modes


@pytest.fixture(params=[0o022, 0o277], ids=["umask022", "umask277"])
def umask(request):
    """The process umask for one test: the usual 022, or one that also strips owner bits."""
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "home"  # not created: ragblend creates it
    monkeypatch.setenv("RAGBLEND_HOME", str(path))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    cases = [
        {"question": QUESTION, "answers": ["Exeter"], "ctxs": [{"title": "", "text": c}]}
        for c in CHUNKS
    ]
    path = tmp_path_factory.mktemp("data") / "cases.json"
    path.write_text(json.dumps(cases))
    return path


def warmup(dataset: Path, model: str, *extra: str) -> list[str]:
    return ["warmup", "--dataset", str(dataset), "--model", model, "--top-k", "1",
            "--chunk-tokens", "32", "--no-progress", *extra]  # fmt: skip


def test_warmup_into_a_store_path_writes_only_owner_private_entries(
    umask, home, tmp_path, dataset, model_dir
):
    store = tmp_path / "deep" / "kv"  # parents missing too
    assert main(warmup(dataset, str(model_dir), "--store-path", str(store))) == 0
    modes = assert_private(store)
    names = set(modes)
    assert {"data", "tmp", "index", "index/index.db"} <= names
    entries = len(DiskStore(store))  # the chunks and the heads; the store still reads
    assert entries == 2 * len(CHUNKS) + 2  # each chunk's own and first-chunk entries
    assert sum(n.endswith(".safetensors") for n in names) == entries
    assert oct(stat.S_IMODE((tmp_path / "deep").stat().st_mode)) == "0o700"


def test_default_store_profiles_and_recovered_index_stay_private_in_a_fresh_home(
    umask, home, tokenizer
):
    store = DiskStore(fsync=False)  # ragblend_home()/kv
    engine = BlendEngine(tiny_model("llama"), tokenizer, BlendConfig(), store)
    engine.precompute(CHUNKS)
    LoadingController.for_engine(engine)  # a profile under home/profiles, a bandwidth probe
    entries = len(store)
    store.close()
    (store.path / "index" / "index.db").write_bytes(b"not a database" * 100)
    again = DiskStore(store.path, fsync=False)  # moved aside and rebuilt
    assert len(again) == entries and again.index.recoveries == 1
    again.close()
    modes = assert_private(home)
    assert any(n.startswith("profiles/") and n.endswith(".json") for n in modes)
    assert any(n.startswith("kv/index.corrupt-") for n in modes)


def test_a_loose_existing_store_warns_once_and_cache_verify_reports_it(
    tmp_path, tokenizer, caplog, capsys
):
    root = tmp_path / "shared-kv"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    with caplog.at_level(logging.WARNING, logger="ragblend.private"):
        engine = BlendEngine(tiny_model("llama"), tokenizer, BlendConfig(), DiskStore(root))
        engine.precompute(CHUNKS[:1])
        DiskStore(root).close()
        private_dir(root)
    warnings = [r.getMessage() for r in caplog.records if r.name == "ragblend.private"]
    assert len(warnings) == 1
    assert str(root) in warnings[0] and f"chmod 700 {root}" in warnings[0]
    os.chmod(root / "data", 0o750)  # and one inner directory others can read too
    capsys.readouterr()
    assert main(["cache", "verify", "--store-path", str(root)]) == 0  # entries are fine
    out = capsys.readouterr().out
    assert "2 entries are accessible to other users" in out
    assert f"chmod -R go-rwx {root}" in out and f" 755  {root}\n" in out
    assert main(["cache", "verify", "--store-path", str(root), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["loose_permissions"] == [
        {"path": str(root), "mode": "755"},
        {"path": str(root / "data"), "mode": "750"},
    ]
    os.chmod(root, 0o700)
    os.chmod(root / "data", 0o700)
    assert main(["cache", "verify", "--store-path", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["loose_permissions"] == []


def test_an_existing_private_directory_gets_no_warning(tmp_path, caplog):
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    with caplog.at_level(logging.WARNING, logger="ragblend.private"):
        DiskStore(root).close()
    assert [r for r in caplog.records if r.name == "ragblend.private"] == []


@pytest.mark.slow
def test_warmup_cli_into_a_fresh_home_records_the_embedded_model_privately(tmp_path, dataset):
    """The issue's check: umask 022, ``ragblend warmup`` (embedded model) into a fresh home."""
    home = tmp_path / "home"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAGBLEND_HOME": str(home)}
    env["OMP_NUM_THREADS"] = "1"
    args = warmup(dataset, "embedded")
    proc = subprocess.run(
        [sys.executable, "-m", "ragblend.cli", *args, "--limit", "1"],
        env=env,
        capture_output=True,
        text=True,
        preexec_fn=lambda: os.umask(0o022),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    modes = assert_private(home)
    # the GGUF runs as it is: only its config, tokenizer and source record are written
    recorded = [n for n in modes if n.startswith("models/gguf-") and n.endswith("/source.json")]
    assert len(recorded) == 1, sorted(modes)
    assert recorded[0].replace("source.json", "config.json") in modes
    assert not [n for n in modes if n.endswith(".safetensors") and n.startswith("models/")]
    assert "kv/index/index.db" in modes
    entry_files = [n for n in modes if n.startswith("kv/") and n.endswith(".safetensors")]
    # one chunk twice (its own entry and the first chunk's) and two heads (canonical, prompt)
    assert len(entry_files) == 4
