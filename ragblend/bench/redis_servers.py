"""Local ``redis-server`` processes for tests and benchmarks: one server, or a Redis Cluster of
masters with replicas, each node a real process on a free loopback port in a directory of its
own. Servers are started with persistence off and killed with SIGKILL (an abrupt death, as in a
crash); the cluster can lose a master (its replica takes over), lose a whole shard, and migrate
a slot by hand while clients read and write.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

NODE_TIMEOUT_MS = 1000  # how long a cluster master may be silent before its replica takes over


def find_binary(*names: str) -> str:
    """Path of the first of ``names`` on PATH (``make install`` installs redis-server)."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    raise FileNotFoundError(f"{' or '.join(names)} is not installed: run `make install`")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_port() -> int:
    """A free loopback port whose cluster bus port (port + 10000) is free and valid too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    """One redis-server process; ``stop()``/``start()`` kill and restart it on the same port.

    ``password`` alone sets ``requirepass`` (the default user's password); with ``username``
    too it adds that ACL user (all keys and commands) and turns the default user off.
    """

    def __init__(
        self,
        directory: Path,
        port: int | None = None,
        maxmemory: str | None = None,
        extra: list[str] | None = None,
        password: str | None = None,
        username: str | None = None,
        binary: str | None = None,
    ):
        self.binary = binary or find_binary("redis-server", "valkey-server")
        self.dir = Path(directory)
        self.extra = list(extra or [])
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.password = password
        self.username = username
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The server's URL, credentials included."""
        auth = ""
        if self.password:
            auth = f"{self.username or ''}:{self.password}@"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _auth_args(self) -> list[str]:
        if self.password and self.username:
            acl = [self.username, "on", f">{self.password}", "~*", "&*", "+@all"]
            return ["--user", *acl, "--user", "default", "off"]
        if self.password:
            return ["--requirepass", self.password]
        return []

    def start(self) -> RedisServer:
        self.dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
            "--protected-mode",
            "no",
            "--loglevel",
            "warning",
        ]
        cmd += self._auth_args() + self.extra
        if self.maxmemory:
            cmd += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited at start: {err}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not answer PING within 20 s")

    def stop(self) -> None:
        """Kill the server (SIGKILL: an abrupt death, as in a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RedisClusterNodes:
    """``masters`` masters with ``replicas`` replicas each; ``url`` names the first node only
    (a client finds the rest from it, as ragblend does)."""

    def __init__(self, directory: Path, masters: int = 3, replicas: int = 1) -> None:
        self.dir = Path(directory)
        self.masters, self.replicas = masters, replicas
        extra = [
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
            "--cluster-require-full-coverage", "no",  # the other shards serve during an outage
            "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0",
            "--cluster-replica-validity-factor", "0",  # a replica may always take over
        ]  # fmt: skip
        self.nodes: list[RedisServer] = []
        for i in range(masters * (1 + replicas)):
            node_dir = self.dir / f"node{i}"
            node_dir.mkdir(parents=True, exist_ok=True)
            self.nodes.append(RedisServer(node_dir, port=cluster_port(), extra=extra))

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> RedisClusterNodes:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        cli = find_binary("redis-cli", "valkey-cli")
        create = [cli, "--cluster", "create", *addresses]
        create += ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
        subprocess.run(create, check=True, capture_output=True, timeout=60)
        self.wait_until_ok()

    def client(self, node: RedisServer) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=2)

    def wait_until_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says ``cluster_state:ok`` and sees every slot served."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = []
            for node in self.live():
                try:
                    info = self.client(node).cluster("info")
                    ok = info["cluster_state"] == "ok" and int(info["cluster_slots_ok"]) == 16384
                    states.append(ok)
                except redis.RedisError:
                    states.append(False)
            if states and all(states):
                return
            time.sleep(0.1)
        raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")

    def kill_master(self, port: int, timeout: float = 30.0) -> None:
        """SIGKILL the master on ``port`` and wait until a replica serves its slots."""
        self.node(port).stop()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if port not in self.master_ports():
                    self.wait_until_ok(timeout=max(0.1, deadline - time.monotonic()))
                    return
            except redis.RedisError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"no replica took over the slots of {port}")

    def kill_shard(self, port: int) -> None:
        """SIGKILL the master on ``port`` and its replicas: its slots stay unserved."""
        with self.client(self.node(port)) as c:
            me = c.cluster("myid")
            me = me.decode() if isinstance(me, bytes) else me
            replicas = [n for n in self.live() if n.port != port and self._master_id(n) == me]
        for node in [self.node(port), *replicas]:
            node.stop()

    def _master_id(self, node: RedisServer) -> str | None:
        with self.client(node) as c:
            info = c.info("replication")
        if info.get("role") != "slave":
            return None
        master = self.node(int(info["master_port"]))
        with self.client(master) as c:
            me = c.cluster("myid")
        return me.decode() if isinstance(me, bytes) else me

    def wait_until_replicated(self, timeout: float = 30.0) -> None:
        """Until every live replica is in sync with its master (its link up, no offset lag)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lagging = False
            for node in self.live():
                with self.client(node) as c:
                    info = c.info("replication")
                if info.get("role") == "master":
                    offset = info.get("master_repl_offset", 0)
                    slaves = [v for k, v in info.items() if k.startswith("slave")]
                    behind = [
                        s for s in slaves if isinstance(s, dict) and s.get("offset") != offset
                    ]
                    lagging |= bool(behind)
                else:
                    lagging |= info.get("master_link_status") != "up"
            if not lagging:
                return
            time.sleep(0.05)
        raise RuntimeError("replicas did not catch up")

    def migrate_slot(self, slot: int, source: int, target: int, pause: float = 0.5) -> None:
        """Move ``slot`` from the master on ``source`` to the one on ``target`` by hand, as
        ``redis-cli --cluster reshard`` does: IMPORTING/MIGRATING, MIGRATE key by key with
        ``pause`` seconds between steps (clients meet ASK redirections meanwhile), then
        SETSLOT NODE on every master."""
        src, dst = self.client(self.node(source)), self.client(self.node(target))
        src_id, dst_id = (c.cluster("myid") for c in (src, dst))
        src_id = src_id.decode() if isinstance(src_id, bytes) else src_id
        dst_id = dst_id.decode() if isinstance(dst_id, bytes) else dst_id
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        time.sleep(pause)
        while True:
            keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1)
            if not keys:
                break
            src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
            time.sleep(pause)
        for port in self.master_ports():
            with self.client(self.node(port)) as c:
                c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        src.close()
        dst.close()

    def live(self) -> list[RedisServer]:
        return [node for node in self.nodes if node.proc is not None]

    def master_ports(self) -> list[int]:
        """Ports of the live masters that serve slots."""
        live = self.live()
        with self.client(live[0]) as c:
            slots = c.cluster("slots")
        return sorted({int(entry[2][1]) for entry in slots})

    def owner_of(self, slot: int) -> int:
        """The port of the master that serves ``slot``."""
        with self.client(self.live()[0]) as c:
            for start, end, master, *_ in c.cluster("slots"):
                if int(start) <= slot <= int(end):
                    return int(master[1])
        raise LookupError(f"slot {slot} has no master")

    def node(self, port: int) -> RedisServer:
        return next(node for node in self.nodes if node.port == port)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisClusterNodes:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
