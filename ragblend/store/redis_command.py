"""``ragblend cache stats|verify|gc --redis-url URL [--namespace NAME]``: the shared Redis tier."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ragblend.errors import RagblendError
from ragblend.store.redis import FORMAT_VERSION, RedisStore


def stats(store: RedisStore) -> dict:
    """Entry count and bytes under the store's prefix/namespace, and the server's memory."""
    keys = list(store.keys())
    nbytes = sum(int(store.client.memory_usage(store.redis_key(k)) or 0) for k in keys)
    return {
        "url": store.url,  # credentials masked
        "namespace": store.namespace,
        "format_version": FORMAT_VERSION,
        "entries": len(keys),
        "bytes": nbytes,
        "server": store.server_info(),
    }


def verify(store: RedisStore, drop: bool = False) -> dict:
    """Read every entry's header and layers and check them (``drop``: delete those that fail)."""
    errors: list[tuple[str, str]] = []
    report: dict[str, Any] = {"ok": 0, "corrupt": 0, "foreign": 0, "errors": errors}
    for key in store.keys():
        reason = store.check(key)
        if reason is None:
            report["ok"] += 1
            continue
        if reason == "missing":  # evicted while we scanned
            continue
        kind = "foreign" if reason.startswith("foreign") else "corrupt"
        report[kind] += 1
        errors.append((key, reason))
        if drop:
            store.discard(key)
    return report


def run_redis(args: argparse.Namespace) -> int:
    store = RedisStore(args.redis_url, namespace=args.namespace)
    try:
        if not store.ping():
            raise RagblendError(f"cannot reach Redis at {store.url}: {store.last_error}")
        if args.cache_command == "stats":
            report, code = stats(store), 0
        elif args.cache_command == "verify":
            report = verify(store, drop=args.drop)
            bad = report["corrupt"] + report["foreign"]
            report["dropped"] = bad if args.drop else 0
            code = 1 if bad and not args.drop else 0
        else:  # gc: Redis's maxmemory policy evicts; gc drops what does not verify
            if args.max_bytes is not None:
                raise RagblendError("--max-bytes: set maxmemory on the Redis server instead")
            report = verify(store, drop=True)
            report["dropped"] = report["corrupt"] + report["foreign"]
            code = 0
    finally:
        store.close()
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    elif args.cache_command == "stats":
        server = report["server"]
        ns = f" namespace {report['namespace']}" if report["namespace"] else ""
        print(f"redis      {report['url']}{ns} (format v{report['format_version']})")
        print(f"entries    {report['entries']} ({report['bytes']:,} B)")
        print(
            f"server     used {server['used_memory']:,} B of maxmemory "
            f"{server['maxmemory']:,} B ({server['maxmemory_policy']}); "
            f"{server['evicted_keys']} evicted keys"
        )
    else:
        print(f"ok {report['ok']}, corrupt {report['corrupt']}, foreign {report['foreign']}")
        for key, reason in report["errors"]:
            print(f"  {key[:16]}…  {reason}")
        if report.get("dropped"):
            print(f"dropped {report['dropped']} entries")
    return code
