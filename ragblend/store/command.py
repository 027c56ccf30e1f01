"""``ragblend cache stats | verify | gc``: inspect and repair the disk KV store."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, cast

from ragblend.store.cli import StoreFlags, add_store_arguments, open_store

if TYPE_CHECKING:
    from ragblend.store.disk import DiskStore


def add_parser(sub) -> None:
    p = sub.add_parser("cache", help="inspect, verify and clean the disk KV store")
    cmds = p.add_subparsers(dest="cache_command", required=True)
    for name, text in (
        ("stats", "entry count, sizes per tier, hit/miss counters"),
        ("verify", "read every entry and check its checksums and metadata"),
        ("gc", "drop corrupt/foreign entries, orphan and stale temp files; evict to --max-bytes"),
    ):
        c = cmds.add_parser(name, help=text, description=text)
        c.set_defaults(func=run)
        add_store_arguments(c, namespace_help="with --redis-url: one tenant's keys")
        c.add_argument("--json", action="store_true", help="print the report as JSON")
        if name == "verify":
            c.add_argument("--drop", action="store_true", help="drop the entries that fail")
            c.add_argument(
                "--rebuild",
                action="store_true",
                help="first move the index aside and rebuild it from the entry files",
            )
        if name == "gc":
            c.add_argument(
                "--max-bytes",
                type=int,
                default=None,
                help="evict least recently used entries down to this size",
            )
            c.add_argument(
                "--grace",
                type=float,
                default=3600.0,
                help="leave unindexed/temp files younger than this many seconds",
            )
    from ragblend.store.plan import add_plan_parser, run_plan

    add_plan_parser(cmds)
    cmds.choices["plan"].set_defaults(func=run_plan)


def run(args: argparse.Namespace) -> int:
    if args.redis_url:
        from ragblend.store.redis_command import run_redis

        return run_redis(args)
    store = cast("DiskStore", open_store(StoreFlags(args.store_path), existing=True))
    try:
        if args.cache_command == "stats":
            report = stats(store)
            code = 0
        elif args.cache_command == "verify":
            rebuilt = store.rebuild_index() if args.rebuild else None
            report = store.verify(drop=args.drop)
            if rebuilt is not None:
                report["rebuilt"] = rebuilt
            report["path"] = str(store.path)
            report["loose_permissions"] = loose_permissions(store.path)
            bad = report["corrupt"] + report["foreign"]
            report["dropped"] = bad if args.drop else 0
            code = 1 if bad and not args.drop else 0
        else:
            if args.max_bytes is not None:
                store.capacity_bytes = int(args.max_bytes)
            report = store.gc(grace_s=args.grace)
            code = 0
    finally:
        store.close()
    _print(args.cache_command, report, args.json)
    return code


def loose_permissions(root: Path) -> list[dict]:
    """Entries of the store that the group or others can access (``path``, octal ``mode``)."""
    from ragblend.private import loose_paths

    return [{"path": str(path), "mode": f"{mode:o}"} for path, mode in loose_paths(root)]


def stats(store) -> dict:
    """Sizes and counters of a disk store (the RAM tier lives inside each process)."""
    from ragblend.store.disk import FORMAT_VERSION, checksum_algorithm

    per_dtype: dict[str, dict] = {}
    for entry in store.index.lru():
        row = per_dtype.setdefault(entry.kv_dtype, {"entries": 0, "bytes": 0, "tokens": 0})
        row["entries"] += 1
        row["bytes"] += entry.bytes
        row["tokens"] += entry.tokens
    for row in per_dtype.values():
        row["bytes_per_token"] = round(row["bytes"] / max(1, row["tokens"]), 1)
    return {
        "path": str(store.path),
        "format_version": FORMAT_VERSION,
        "checksum": checksum_algorithm(),
        "entries": len(store),
        "tiers": {
            "disk": {"bytes": store.nbytes, "on_disk": store.disk_usage()},
            "ram": "per process (not persistent)",
        },
        "kv_dtypes": per_dtype,
        "counters": store.counters(),
    }


def _print(command: str, report: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2, default=str))
        return
    if command == "stats":
        disk = report["tiers"]["disk"]
        c = report["counters"]
        lookups = c["hits"] + c["misses"]
        rate = f" ({c['hits'] / lookups:.0%} hits)" if lookups else ""
        print(
            f"store      {report['path']} (format v{report['format_version']}, "
            f"{report['checksum']})"
        )
        print(f"entries    {report['entries']}")
        print(
            f"disk tier  {disk['bytes']:,} B of entries; on disk: data "
            f"{disk['on_disk']['data']:,} B, index {disk['on_disk']['index']:,} B, "
            f"temp {disk['on_disk']['tmp']:,} B"
        )
        print("ram tier   per process (not persistent)")
        for name, row in sorted(report["kv_dtypes"].items()):
            print(
                f"kv_dtype   {name:<9} {row['entries']} entries, {row['bytes']:,} B, "
                f"{row['bytes_per_token']:,.1f} B/token (file headers included)"
            )
        print(
            f"lookups    {c['hits']} hits, {c['misses']} misses{rate}; "
            f"{c['puts']} puts, {c['evictions']} evictions"
        )
        return
    if report.get("rebuilt") is not None:
        print(f"rebuilt the index from {report['rebuilt']} entry files")
    print(f"ok {report['ok']}, corrupt {report['corrupt']}, foreign {report['foreign']}")
    for key, reason in report["errors"]:
        print(f"  {key[:16]}…  {reason}")
    if command == "verify" and report.get("dropped"):
        print(f"dropped {report['dropped']} entries")
    loose = report.get("loose_permissions") or []
    if loose:
        root = shlex.quote(report["path"])
        print(
            f"permissions: {len(loose)} entries are accessible to other users "
            f"(fix: chmod -R go-rwx {root})"
        )
        for item in loose[:20]:
            print(f"  {item['mode']:>4}  {item['path']}")
        if len(loose) > 20:
            print(f"  … and {len(loose) - 20} more")
    if command == "gc":
        print(
            f"removed {report['orphans']} orphan files, {report['stale_tmp']} stale temp files; "
            f"evicted {report['evicted']} entries"
        )
