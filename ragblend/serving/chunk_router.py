"""A Ray Serve request router that sends a request to the replica holding its chunks.

Configured on the replica deployment (``RequestRouterConfig(request_router_class=
"ragblend.serving.chunk_router.ChunkRouter")``), it runs inside the ingress's
``DeploymentHandle``. The ingress passes each request's chunk ids as the call's ``chunk_ids``
keyword; :meth:`ChunkRouter.choose_replicas` asks :func:`ragblend.serving.affinity.choose` with
its affinity table and the replicas' loads (Serve's queue-length cache, probed when stale) and
ranks the chosen replica first, every other one second (Serve takes the least loaded of the
second rank when the first is full). Each routed request records its chunks against the
replica that got it; a replica that dies or leaves is forgotten.

The routing decisions of every router in this process are counted by replica and reason
(``affinity.ROUTED``), which the ingress exposes in ``/metrics``. Serve pickles this module by
value into each process that routes, so nothing here holds state of its own: the table lives on
the router, the counts in :mod:`ragblend.serving.affinity` (imported, not copied).
"""

from __future__ import annotations

import logging
import random
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from ragblend.serving import affinity

log = logging.getLogger(__name__)

CHUNK_IDS = "chunk_ids"  # the keyword argument that carries a request's chunk ids
ROUTER_PATH = f"{__name__}.ChunkRouter"

MAX_PENDING = 4096  # choices remembered for requests not routed yet (cancelled ones age out)


def chunk_ids_of(pending: PendingRequest | None) -> list[str]:
    """The chunk ids the ingress attached to a call (``[]``: none, or not an ingress call)."""
    if pending is None:
        return []
    ids = (pending.kwargs or {}).get(CHUNK_IDS)
    return [i for i in ids if isinstance(i, str)] if isinstance(ids, (list, tuple)) else []


class ChunkRouter(RequestRouter):
    """Routes by chunk affinity within a load bound (see the module docstring)."""

    def initialize_state(self, **kwargs: Any) -> None:
        """``load_bound``: requests in flight the affinity replica may have beyond the least
        loaded one; ``table_size``: chunk ids remembered."""
        self.load_bound = int(kwargs.get("load_bound", affinity.DEFAULT_LOAD_BOUND))
        self.table = affinity.AffinityTable(
            int(kwargs.get("table_size", affinity.DEFAULT_TABLE_SIZE))
        )
        self._chosen: dict[str, str] = {}  # internal request id -> the replica chosen first
        self._reasons: dict[str, str] = {}  # internal request id -> why

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        shuffled = random.sample(candidate_replicas, len(candidate_replicas))
        loads = await self._loads(shuffled)
        by_id = {r.replica_id.unique_id: r for r in shuffled}
        ids = chunk_ids_of(pending_request)
        choice = affinity.choose(ids, list(by_id), loads, self.table, self.load_bound)
        chosen = by_id[choice.replica]
        if pending_request is not None:
            rid = pending_request.metadata.internal_request_id
            self._chosen[rid], self._reasons[rid] = choice.replica, choice.reason
            while len(self._chosen) > MAX_PENDING:
                oldest = next(iter(self._chosen))
                self._chosen.pop(oldest)
                self._reasons.pop(oldest, None)
        rest = [r for r in shuffled if r is not chosen]
        return [[chosen], rest] if rest else [[chosen]]

    async def _loads(self, replicas: list[RunningReplica]) -> dict[str, int | None]:
        """Requests in flight per replica: Serve's cache, probing the replicas it lacks."""
        cache = self.replica_queue_len_cache
        loads: dict[str, int | None] = {}
        stale = []
        for r in replicas:
            loads[r.replica_id.unique_id] = cache.get(r.replica_id)
            if loads[r.replica_id.unique_id] is None:
                stale.append(r)
        if stale:
            for r, queue_len in await self._probe_queue_lens(stale, 0):
                loads[r.replica_id.unique_id] = queue_len
        return loads

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        rid = pending_request.metadata.internal_request_id
        chosen, reason = self._chosen.pop(rid, None), self._reasons.pop(rid, None)
        replica = replica_id.unique_id
        if reason is not None and chosen != replica:
            reason = affinity.LOAD  # the chosen replica was full: Serve took the least loaded other
        ids = chunk_ids_of(pending_request)
        if ids:
            self.table.record(ids, replica)
        if reason is not None:
            affinity.ROUTED.count(replica, reason)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        dropped = self.table.forget(replica_id.unique_id)
        log.info("replica %s died: %d chunks forgotten", replica_id.unique_id, dropped)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {r.unique_id for r in self._replica_id_set}
        super().update_replicas(replicas)
        for gone in before - {r.unique_id for r in self._replica_id_set}:
            self.table.forget(gone)
