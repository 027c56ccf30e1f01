"""``ragblend warmup --ray [ADDRESS]``: precompute chunk KV on a Ray cluster into the shared tier.

An actor pool: each actor loads the engine once (its own model copy) and precomputes batches of
chunks, writing into the shared Redis tier (``RedisStore``). Resumable: an actor skips every chunk
whose key is already in Redis, so a rerun continues where an interrupted job stopped. The driver
never loads the model; it only hands out batches and shows progress as batches finish.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ragblend.errors import RagblendError

log = logging.getLogger(__name__)


@dataclass
class RayWarmupReport:
    stored: int = 0
    skipped: int = 0
    failed: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def chunks_per_s(self) -> float:
        return (self.stored + self.skipped) / max(self.seconds, 1e-9)


class ChunkWarmer:
    """Body of one Ray actor: an engine writing into Redis; ``warm(batch)`` precomputes texts."""

    def __init__(
        self, model: str, config: dict, redis_url: str, namespace: str | None, threads: int = 1
    ) -> None:
        import torch

        from ragblend.config import BlendConfig
        from ragblend.engine import BlendEngine
        from ragblend.store.redis import RedisStore

        torch.set_num_threads(max(1, threads))
        self.store = RedisStore(redis_url, namespace=namespace, block_when_full=True)
        if not self.store.ping():
            raise RagblendError(f"cannot reach Redis at {self.store.url}: {self.store.last_error}")
        self.engine = BlendEngine.from_pretrained(
            model, config=BlendConfig(**config), store=self.store
        )
        self.head = self.engine.prompt_head()

    def warm(self, texts: Sequence[str]) -> dict:
        """Precompute each text not yet in Redis; returns counts once its writes have landed."""
        from ragblend.prompt import encode

        stored = skipped = 0
        errors: list[str] = []
        failed_before, bytes_before = self.store.write_errors, self.store.bytes_written
        for text in texts:
            try:
                ids = encode(self.engine.tokenizer, text)
                if self.engine.precompute_ids(ids, self.head):
                    stored += 1
                else:
                    skipped += 1
                self.engine.chunks.record_texts([(text, ids)], self.head)
            except Exception as exc:  # one bad chunk must not end the job
                errors.append(str(exc))
        self.store.flush()
        failed = self.store.write_errors - failed_before
        return {
            "stored": stored - failed,
            "skipped": skipped,
            "failed": failed + len(errors),
            "bytes": self.store.bytes_written - bytes_before,
            "errors": errors,
        }


def batches(items: Sequence[str], size: int) -> list[list[str]]:
    return [list(items[i : i + size]) for i in range(0, len(items), max(1, size))]


def warm_on_ray(
    chunks: Sequence[str],
    *,
    model: str,
    redis_url: str,
    namespace: str | None = None,
    config: dict | None = None,
    address: str | None = None,
    actors: int = 2,
    batch_size: int = 8,
    threads_per_actor: int = 1,
    on_batch: Callable[[int], None] | None = None,
) -> RayWarmupReport:
    """Precompute ``chunks`` on Ray actors into Redis at ``redis_url``.

    ``address``: a running cluster (``"auto"``, ``"ray://host:10001"``, ...); None starts or joins
    the local instance (``ray.init``). ``on_batch(n)`` is called as each batch of n chunks finishes.
    """
    try:
        import ray
        from ray.util import ActorPool
    except ImportError:
        raise RagblendError("--ray needs Ray: pip install 'ragblend[ray]'") from None
    if actors < 1 or batch_size < 1:
        raise RagblendError("--ray-actors and --batch-size must be at least 1")
    if not ray.is_initialized():
        ray.init(
            address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True
        )
    remote_cls = ray.remote(num_cpus=threads_per_actor)(ChunkWarmer)
    t0 = time.perf_counter()
    pool_actors = [
        remote_cls.remote(model, config or {}, redis_url, namespace, threads_per_actor)
        for _ in range(actors)
    ]
    report = RayWarmupReport()
    try:
        pool = ActorPool(pool_actors)
        work = batches(list(dict.fromkeys(chunks)), batch_size)
        for done in pool.map_unordered(lambda a, b: a.warm.remote(b), work):
            report.stored += done["stored"]
            report.skipped += done["skipped"]
            report.failed += done["failed"]
            report.bytes_written += done["bytes"]
            report.errors.extend(done["errors"])
            if on_batch is not None:
                on_batch(done["stored"] + done["skipped"] + done["failed"])
    finally:
        for actor in pool_actors:
            ray.kill(actor)  # type: ignore[arg-type]  # ray types remote(cls) as a union
    report.seconds = time.perf_counter() - t0
    return report
