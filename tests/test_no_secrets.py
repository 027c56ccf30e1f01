"""No credentials in logs, errors, reprs or CLI output: a real password-protected redis-server."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CHUNKS, QUESTION, tiny_model
from redis_server import RedisServer

from ragblend import BlendConfig, BlendEngine
from ragblend.cli import main
from ragblend.errors import CorruptEntryError, RagblendError
from ragblend.redact import redact_url, scrub
from ragblend.store import ChunkKV, pack, redis_command
from ragblend.store.redis import PASSWORD_ENV, RedisStore

ROOT = Path(__file__).resolve().parents[1]
USER = "rb-user-4f7e"
PASSWORD = "pw-secret-91c3d"


def assert_no_secret(*texts: object) -> None:
    for text in texts:
        shown = str(text)
        assert PASSWORD not in shown and USER not in shown, shown


@pytest.fixture
def acl_server(tmp_path):
    """A redis-server whose only user is USER with PASSWORD (the default user is off)."""
    with RedisServer(tmp_path, password=PASSWORD, username=USER) as server:
        yield server


@pytest.fixture
def every_log(caplog):
    """Every log record of every logger, at DEBUG."""
    caplog.set_level(logging.DEBUG)
    return caplog


def tiny_engine(tokenizer, store) -> BlendEngine:
    return BlendEngine(tiny_model("llama"), tokenizer, BlendConfig(), store)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://alice:s3cret@h:6379/0", "redis://***:***@h:6379/0"),
        ("rediss://:s3cret@h:6380/1", "rediss://***:***@h:6380/1"),
        ("redis://alice@h:6379/0", "redis://***@h:6379/0"),
        ("redis://alice:s3/cr@t@h:6379/0", "redis://***:***@h:6379/0"),  # unencoded / and @
        ("unix:///run/r.sock?db=1&password=s3cret", "unix:///run/r.sock?db=1&password=***"),
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("not a url", "not a url"),
    ],
)
def test_redact_url_masks_user_and_password_and_keeps_the_server(url, shown):
    assert redact_url(url) == shown


def test_scrub_masks_credentials_and_the_pieces_a_parser_cuts_them_into():
    url = f"redis://{USER}:{PASSWORD[:6]}/{PASSWORD[6:]}@127.0.0.1:6379/0"
    message = f"Port could not be cast to integer value as '{PASSWORD[:6]}' in {url}"
    assert_no_secret(scrub(message, url))
    assert "redis://***:***@127.0.0.1:6379/0" in scrub(message, url)


def test_right_password_hits_and_nothing_shows_the_credentials(acl_server, tokenizer, every_log):
    store = RedisStore(acl_server.url)
    engine = tiny_engine(tokenizer, store)
    engine.precompute(CHUNKS)
    store.flush()
    out = engine.generate(QUESTION, CHUNKS, max_new_tokens=2)
    assert out.stats.chunk_hits == len(CHUNKS) and out.stats.chunk_misses == 0
    assert store.url == f"redis://***:***@127.0.0.1:{acl_server.port}/0"
    assert repr(store) == f"RedisStore('{store.url}')"
    assert_no_secret(store.url, repr(store), repr(store.client), every_log.text)
    store.close()


def test_wrong_password_and_a_stopped_server_are_misses_with_warnings_hiding_the_credentials(
    acl_server, tokenizer, every_log
):
    wrong = RedisStore(acl_server.url.replace(PASSWORD, "not-" + PASSWORD), retry_s=0.0)
    assert not wrong.ping() and wrong.get("a" * 64) is None
    assert "invalid username-password pair" in (wrong.last_error or "")
    store = RedisStore(acl_server.url, retry_s=0.0, connect_timeout=0.5, socket_timeout=0.5)
    engine = tiny_engine(tokenizer, store)
    engine.precompute(CHUNKS)
    store.flush()
    entry = store.get(next(iter(store.keys())))
    acl_server.stop()
    with pytest.raises(CorruptEntryError) as raised:
        entry.layer(0)
    out = engine.generate(QUESTION, CHUNKS, max_new_tokens=2)
    assert out.stats.chunk_hits == 0 and out.stats.chunk_misses == len(CHUNKS)
    acl_server.start()  # empty again (no persistence): "reachable again", then misses
    assert store.ping()
    messages = [r.getMessage() for r in every_log.records]
    unreachable = [m for m in messages if "unreachable" in m]
    assert len(unreachable) == 2  # one per store and outage
    assert any(f"redis://***:***@127.0.0.1:{acl_server.port}/0" in m for m in unreachable)
    assert any("reachable again" in m for m in messages)
    assert_no_secret(
        *messages, every_log.text, raised.value, wrong.last_error, store.last_error, repr(wrong)
    )
    wrong.close()
    store.close()


def test_invalid_urls_are_errors_that_hide_the_credentials():
    bad = [
        f"http://{USER}:{PASSWORD}@127.0.0.1:6379/0",  # wrong scheme
        f"redis://{USER}:{PASSWORD[:6]}/{PASSWORD[6:]}@127.0.0.1:6379/0",  # unencoded '/'
        f"redis://{USER}:{PASSWORD}@127.0.0.1:6379/0?socket_timeout=soon",  # bad argument
    ]
    for url in bad:
        with pytest.raises(RagblendError) as raised:
            RedisStore(url)
        assert "***" in str(raised.value)
        assert_no_secret(raised.value)


def test_the_password_can_come_from_the_environment(acl_server, monkeypatch, capsys):
    url = f"redis://{USER}@127.0.0.1:{acl_server.port}/0"
    assert not RedisStore(url, retry_s=0.0).ping()  # no password: refused
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    store = RedisStore(url)
    assert store.ping() and store.url == f"redis://***@127.0.0.1:{acl_server.port}/0"
    store.close()
    assert main(["cache", "stats", "--redis-url", url]) == 0
    out = capsys.readouterr()
    assert "entries    0" in out.out
    assert_no_secret(out.out, out.err)


def test_cache_and_warmup_commands_never_print_the_credentials(
    acl_server, tmp_path, capsys, every_log
):
    shown = f"redis://***:***@127.0.0.1:{acl_server.port}/0"
    assert main(["cache", "stats", "--json", "--redis-url", acl_server.url]) == 0
    assert json.loads(capsys.readouterr().out)["url"] == shown
    for command in ("stats", "verify", "gc"):
        assert main(["cache", command, "--redis-url", acl_server.url]) == 0
        out = capsys.readouterr()
        assert_no_secret(out.out, out.err)
    acl_server.stop()
    dataset = tmp_path / "cases.json"
    dataset.write_text(json.dumps([{"question": "q?", "answers": ["a"], "ctxs": []}]))
    for argv in (
        ["cache", "stats", "--redis-url", acl_server.url],
        ["warmup", "--dataset", str(dataset), "--redis-url", acl_server.url, "--no-progress"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"cannot reach Redis at {shown}" in err
        assert_no_secret(err)
    assert_no_secret(every_log.text)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_bench_cli_against_a_password_protected_redis_never_prints_the_password(
    acl_server, model_dir, tmp_path
):
    """The real CLI in a subprocess, at INFO: server up, then stopped (misses, warnings)."""
    dataset = tmp_path / "cases.json"
    ctxs = [{"title": "", "text": c} for c in CHUNKS]
    dataset.write_text(json.dumps([{"question": QUESTION, "answers": ["Exeter"], "ctxs": ctxs}]))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

    def bench(out: Path) -> tuple[str, str]:
        args = ["-v", "bench", "--dataset", str(dataset), "--limit", "1", "--top-k", "3",
                "--chunk-tokens", "32", "--modes", "full,blend", "--repeats", "1",
                "--max-new-tokens", "2", "--model", str(model_dir), "--tier", "redis",
                "--redis-url", acl_server.url, "--out", str(out)]  # fmt: skip
        proc = subprocess.run(
            [sys.executable, "-m", "ragblend.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr
        assert_no_secret(proc.stdout, proc.stderr, (out / "results.json").read_text())
        return proc.stdout, proc.stderr

    _, err = bench(tmp_path / "up")
    assert "unreachable" not in err
    acl_server.stop()
    _, err = bench(tmp_path / "down")
    assert f"Redis KV tier at redis://***:***@127.0.0.1:{acl_server.port}/0 is unreachable" in err


def test_the_acl_user_docs_security_md_describes_is_enough_and_sees_no_other_keys(acl_server):
    import redis

    admin = redis.Redis.from_url(acl_server.url)
    rules = "~ragblend:kv:* resetchannels -@all +@read +@write +@keyspace +@transaction"
    admin.execute_command(
        "ACL", "SETUSER", "svc", "on", ">svc-password", *rules.split(), "+@connection", "+info",
        "+memory",
    )  # fmt: skip
    admin.set("other:app", "private")
    url = f"redis://svc:svc-password@127.0.0.1:{acl_server.port}/0"
    store = RedisStore(url, namespace="tenant-a")
    kv = pack(ChunkKV(torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4), {"tokens": 3}), "float32")
    store.put("a" * 64, kv)
    store.flush()
    assert store.write_errors == 0
    assert torch.equal(store.get("a" * 64).layer(1)[0], kv.k[1])
    assert list(store.keys()) == ["a" * 64]
    assert redis_command.stats(store)["entries"] == 1
    assert redis_command.verify(store)["ok"] == 1
    with pytest.raises(redis.exceptions.NoPermissionError):
        redis.Redis.from_url(url).get("other:app")
    store.close()
