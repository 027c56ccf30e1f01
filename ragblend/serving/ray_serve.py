"""``ragblend serve --ray``: the OpenAI-compatible API from N Ray Serve replicas sharing one store.

Two deployments in one Serve application (``ragblend``, route prefix ``/``):

- ``ragblend-replica`` (N replicas, ``--replica-cpus`` each): :class:`~ragblend.serving.
  ray_replica.ChunkReplica`, an engine with its own RAM tier in front of the shared Redis tier,
  running the server app in-process. Requests reach it through the chunk router
  (:mod:`ragblend.serving.chunk_router`) or, with ``--routing pow2``, Serve's default
  power-of-two-choices router. Serve checks each replica's health and replaces one that dies.
- ``ragblend-ingress`` (one replica, no CPU reserved): :class:`~ragblend.serving.ray_ingress.
  ChunkIngress`, which reads each request, finds its chunks and relays it to a replica.

Ray's HTTP proxy listens on ``--host``/``--port``. Imported only with ``--ray``: ``ragblend
serve`` alone never imports Ray.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from ragblend.errors import RagblendError
from ragblend.serving.affinity import DEFAULT_LOAD_BOUND
from ragblend.serving.ray_replica import ChunkReplica, ReplicaSettings

try:
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.handle import DeploymentHandle
    from ray.serve.request_router import RequestRouter  # noqa: F401  (Serve with routers)
except ImportError as exc:  # pragma: no cover - depends on the install
    raise RagblendError(
        f"`ragblend serve --ray` needs Ray Serve: pip install 'ragblend[ray]' ({exc})"
    ) from None

from ragblend.serving.chunk_router import ROUTER_PATH
from ragblend.serving.ray_ingress import ChunkIngress

log = logging.getLogger(__name__)

APP_NAME = "ragblend"
REPLICA_DEPLOYMENT, INGRESS_DEPLOYMENT = "ragblend-replica", "ragblend-ingress"
ROUTINGS = ("chunk", "pow2")
HEALTH_CHECK_PERIOD_S = 5.0
EXTRA_IN_FLIGHT = 4  # calls a replica takes beyond its queue: health reports, text scope

RayIngress = serve.ingress()(ChunkIngress)


@dataclass(frozen=True)
class RayOptions:
    """How the replicas are laid out and routed to."""

    replicas: int = 2
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    routing: str = "chunk"  # "chunk" (ChunkRouter) or "pow2" (Serve's default)
    load_bound: int = DEFAULT_LOAD_BOUND

    def check(self) -> None:
        if self.replicas < 1:
            raise RagblendError(f"--replicas must be at least 1, got {self.replicas}")
        if self.replica_cpus <= 0:
            raise RagblendError(f"--replica-cpus must be > 0, got {self.replica_cpus}")
        if self.routing not in ROUTINGS:
            raise RagblendError(f"--routing must be one of {', '.join(ROUTINGS)}")
        if self.load_bound < 0:
            raise RagblendError(f"--route-load-bound must be >= 0, got {self.load_bound}")


def check_serve_version() -> None:
    """Raise a clear error when the installed Ray Serve lacks what ``--ray`` uses."""
    if not hasattr(DeploymentHandle, "broadcast"):
        raise RagblendError(
            f"`ragblend serve --ray` needs Ray Serve's request routers and "
            f"DeploymentHandle.broadcast (Ray 2.60 or later); this is Ray {ray.__version__}: "
            "pip install -U 'ragblend[ray]'"
        )


def build_app(settings: ReplicaSettings, options: RayOptions) -> Any:
    """The Serve application: the ingress bound to the replica deployment."""
    options.check()
    if options.routing == "chunk":
        router = RequestRouterConfig(
            request_router_class=ROUTER_PATH,  # type: ignore[arg-type]  # str or class
            request_router_kwargs={"load_bound": options.load_bound},
        )
    else:
        router = RequestRouterConfig()
    replica = serve.deployment(
        name=REPLICA_DEPLOYMENT,
        num_replicas=options.replicas,
        ray_actor_options={"num_cpus": options.replica_cpus, "num_gpus": options.replica_gpus},
        max_ongoing_requests=settings.max_running + settings.max_queue + EXTRA_IN_FLIGHT,
        request_router_config=router,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=5.0,
    )(ChunkReplica)
    ingress = serve.deployment(
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=10_000,
    )(RayIngress)
    return ingress.bind(replica.bind(settings), settings.redis_url, settings.namespace)


def start(
    settings: ReplicaSettings,
    options: RayOptions,
    *,
    address: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
) -> bool:
    """Join (``address``) or start a Ray instance, start Serve's HTTP proxy on ``host:port``
    and deploy the application; returns once every replica has loaded its model. True when
    this call started Ray (the caller shuts it down)."""
    check_serve_version()
    options.check()
    started = False
    if not ray.is_initialized():
        if address in (None, "local"):
            cpus = max(os.cpu_count() or 1, math.ceil(options.replicas * options.replica_cpus))
            ray.init(num_cpus=cpus, include_dashboard=False)
        else:
            ray.init(address=address, include_dashboard=False)
        started = True
    serve.start(http_options={"host": host, "port": port})
    try:
        serve.run(build_app(settings, options), name=APP_NAME, route_prefix="/")
    except RuntimeError as exc:
        raise RagblendError(f"the replicas did not start: {exc}") from None
    return started


def serve_forever(
    settings: ReplicaSettings,
    options: RayOptions,
    *,
    address: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
) -> int:
    """``ragblend serve --ray``: deploy, serve until interrupted (Ctrl-C or SIGTERM), then
    take the application down (and Ray, when this process started it)."""

    def interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    started = False
    try:
        started = start(settings, options, address=address, host=host, port=port)
        print(
            f"serving {settings.model} on http://{host}:{port} from {options.replicas} Ray Serve "
            f"replicas ({options.routing} routing)",
            flush=True,
        )
        signal.signal(signal.SIGTERM, interrupt)
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        if ray.is_initialized():
            serve.shutdown()
            if started:
                ray.shutdown()
    return 0
