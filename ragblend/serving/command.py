"""``ragblend serve``: an OpenAI-compatible blend server (``/v1/chat/completions`` and more).

Chunks warmed into the same store (``ragblend warmup``, another server, an integration, or
``POST /v1/ragblend/chunks``) are found in any request's text and blended; each response says
what happened in its ``ragblend`` object. Binds 127.0.0.1 unless told otherwise; with
``--api-key`` / ``--api-key-file`` (or RAGBLEND_API_KEY) every /v1 path needs
``Authorization: Bearer <key>``. /health answers 503 until the model is loaded.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from ragblend.config import DECODE_ACTIVATIONS, KV_CACHE_DTYPES, kv_dtype_argument
from ragblend.errors import RagblendError
from ragblend.kernels import LAYER_KERNELS
from ragblend.store.cli import StoreFlags, add_store_arguments, open_store

log = logging.getLogger(__name__)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible API that blends known chunks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", metavar="M", default="embedded", help="'embedded', a local HF dir or a .gguf"
    )
    p.add_argument(
        "--host", metavar="ADDR", default="127.0.0.1", help="address to bind (default 127.0.0.1)"
    )
    p.add_argument("--port", metavar="N", type=int, default=8000, help="port (default 8000)")
    add_store_arguments(p)
    p.add_argument(
        "--dtype", metavar="D", default="auto", help="auto / float32 / bfloat16 / float16"
    )
    p.add_argument(
        "--weights",
        metavar="W",
        default="auto",
        choices=("auto", "dequantize"),
        help="a GGUF's quantized tensors: auto (kept as blocks) or dequantize",
    )
    p.add_argument("--device", metavar="D", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--kv-dtype",
        metavar="D",
        type=kv_dtype_argument,
        default="auto",
        help="storage dtype or codec of chunk KV, as `ragblend warmup` wrote them: auto "
        "(default), float32, bfloat16, float16, int8, int4, int2 or pca<bits>",
    )
    p.add_argument(
        "--kv-cache-dtype",
        metavar="T",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="the decode-time K/V cache: auto (the model's dtype) or int8 (8-bit codes with "
        "a scale per 32 values)",
    )
    p.add_argument(
        "--decode-activations",
        metavar="A",
        default="auto",
        choices=DECODE_ACTIVATIONS,
        help="what decode steps multiply a GGUF's quantized weights by: float (exact), int8 "
        "(llama.cpp's 8-bit activations) or auto (per CPU level)",
    )
    p.add_argument(
        "--layer-kernels",
        metavar="K",
        default="auto",
        choices=LAYER_KERNELS,
        help="a prefill's layer steps off the native CPU kernels: hf (HF's modules), fused "
        "(one op per norm, RoPE, K/V scatter and SiLU product; Triton kernels on CUDA) or "
        "auto (hf)",
    )
    p.add_argument(
        "--decode-slots",
        metavar="N",
        type=int,
        default=None,
        help="requests the static decode K/V pool holds (default: 8 on a GPU, 0 = off on a CPU)",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="replay the decode pool's step from a CUDA graph (GPU; eager with one warning "
        "where the capture fails)",
    )
    p.add_argument(
        "--api-key",
        metavar="KEY",
        action="append",
        default=[],
        help="require `Authorization: Bearer KEY` on /v1 paths (repeatable; also "
        "$RAGBLEND_API_KEY)",
    )
    p.add_argument(
        "--api-key-file",
        metavar="FILE",
        default=None,
        help="more keys, one per line (blank lines and # comments ignored)",
    )
    p.add_argument(
        "--allowed-origins",
        metavar="ORIGINS",
        action="append",
        default=[],
        help="CORS origins allowed to call the API (repeatable or comma-separated; none by "
        "default)",
    )
    p.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=float,
        default=None,
        help="seconds a request may take before it is cancelled and answered with an error "
        "(default: none)",
    )
    p.add_argument(
        "--served-model-name", metavar="NAME", default=None, help="the model name clients send"
    )
    p.add_argument(
        "--max-running", metavar="N", type=int, default=8, help="requests decoded together"
    )
    p.add_argument(
        "--max-queue", metavar="N", type=int, default=64, help="waiting requests before 429"
    )
    p.add_argument("--max-tokens", metavar="N", type=int, default=256, help="default max_tokens")
    p.add_argument(
        "--ram-bytes",
        metavar="N",
        type=int,
        default=None,
        help="capacity of the RAM tier in front of the store, per process (default 4 GiB)",
    )
    ray = p.add_argument_group("Ray Serve replicas (--ray; needs --redis-url)")
    ray.add_argument(
        "--ray",
        metavar="ADDRESS",
        nargs="?",
        const="local",
        default=None,
        help="serve from Ray Serve replicas sharing the --redis-url store: a cluster address "
        "('auto', 'ray://host:10001') or none for a local Ray instance",
    )
    ray.add_argument("--replicas", metavar="N", type=int, default=None, help="replicas (default 2)")
    ray.add_argument(
        "--replica-cpus",
        metavar="C",
        type=float,
        default=None,
        help="CPUs each replica reserves and computes on (default 1)",
    )
    ray.add_argument(
        "--routing",
        metavar="R",
        default=None,
        choices=("chunk", "pow2"),
        help="chunk (default: to the replica that served the request's chunks recently) or "
        "pow2 (Ray Serve's power of two choices)",
    )
    ray.add_argument(
        "--route-load-bound",
        metavar="N",
        type=int,
        default=None,
        help="requests in flight the chunk's replica may have beyond the least loaded one "
        "before a request goes to the least loaded (default 4)",
    )
    p.set_defaults(func=run)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_keys(given: Sequence[str], key_file: str | None, env: str | None) -> list[str]:
    """Every accepted key: ``--api-key`` values, the lines of ``--api-key-file`` (blank lines
    and ``#`` comments skipped) and ``$RAGBLEND_API_KEY``, each once."""
    keys = [k.strip() for k in given]
    if key_file:
        try:
            lines = Path(key_file).read_text().splitlines()
        except OSError as exc:
            raise RagblendError(f"cannot read --api-key-file {key_file}: {exc}") from None
        keys += [line.strip() for line in lines]
    keys.append((env or "").strip())
    keys = [k for k in keys if k and not k.startswith("#")]
    return list(dict.fromkeys(keys))


def origins(values: Sequence[str]) -> list[str]:
    """``--allowed-origins`` values, each repeatable or a comma-separated list."""
    return [o.strip() for v in values for o in v.split(",") if o.strip()]


def warn_if_exposed(host: str, api_key: str | Sequence[str] | None) -> bool:
    """Log a warning (and return True) when ``host`` is not loopback and there is no key."""
    if api_key or is_loopback(host):
        return False
    log.warning(
        "serving on %s without an API key: anyone who can reach it can use the model and the "
        "cached documents; set --api-key or RAGBLEND_API_KEY",
        host,
    )
    return True


RAY_FLAGS = {
    "replicas": "--replicas",
    "replica_cpus": "--replica-cpus",
    "routing": "--routing",
    "route_load_bound": "--route-load-bound",
}


def config_fields(args: argparse.Namespace) -> dict:
    """``BlendConfig``'s keyword arguments from the flags (plain data: Ray sends it on)."""
    return {
        "device": args.device,
        "dtype": args.dtype,
        "weights": args.weights,
        "namespace": args.namespace,
        "kv_dtype": args.kv_dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "decode_activations": args.decode_activations,
        "layer_kernels": args.layer_kernels,
        "decode_slots": args.decode_slots,
        "cuda_graphs": args.cuda_graphs,
    }


def model_names(args: argparse.Namespace) -> tuple[str, ...]:
    """The names requests may use: ``--served-model-name``, then ``--model``."""
    return tuple(dict.fromkeys(n for n in (args.served_model_name, args.model) if n))


def checked_keys(args: argparse.Namespace) -> list[str]:
    """The API keys, after checking ``--timeout`` and warning about an exposed host."""
    keys = api_keys(args.api_key, args.api_key_file, os.environ.get("RAGBLEND_API_KEY"))
    if args.timeout is not None and args.timeout <= 0:
        raise RagblendError(f"--timeout must be > 0, got {args.timeout}")
    warn_if_exposed(args.host, keys)
    return keys


def run(args: argparse.Namespace) -> int:
    if args.ray is not None:
        return run_on_ray(args)
    given = [flag for name, flag in RAY_FLAGS.items() if getattr(args, name) is not None]
    if given:
        raise RagblendError(f"{', '.join(given)} only apply with --ray")
    try:
        import uvicorn

        from ragblend.serving.app import create_app
    except ImportError as exc:
        raise RagblendError(
            f"`ragblend serve` needs pip install 'ragblend[serve]' ({exc})"
        ) from None
    from ragblend.config import BlendConfig
    from ragblend.engine import BlendEngine

    keys = checked_keys(args)
    config = BlendConfig(**config_fields(args))
    store = open_store(StoreFlags.of(args), ram_front=True, ram_bytes=args.ram_bytes)
    app = create_app(
        lambda: BlendEngine.from_pretrained(args.model, config=config, store=store),
        model_names=model_names(args),
        api_key=keys,
        max_running=args.max_running,
        max_queue=args.max_queue,
        default_max_tokens=args.max_tokens,
        scheduler_thread=False,
        timeout_s=args.timeout,
        allowed_origins=origins(args.allowed_origins),
    )
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info"))

    def serve_http() -> None:
        try:
            server.run()
        finally:
            app.state.server.stop()

    http = threading.Thread(target=serve_http, name="ragblend-http")
    http.start()  # /health answers 503 while the model loads
    try:  # the thread that loads the model computes: one OpenMP team (ragblend.threads)
        app.state.server.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        http.join()
    if not server.started:
        raise RagblendError(f"could not serve on {args.host}:{args.port} (see the log above)")
    return 0


def run_on_ray(args: argparse.Namespace) -> int:
    """``ragblend serve --ray``: the same app from Ray Serve replicas sharing ``--redis-url``."""
    if not args.redis_url:
        raise RagblendError(
            "--ray serves from replicas that share chunks through the store: give --redis-url "
            "(a Redis server or any node of a Redis Cluster); --store-path or the default disk "
            "store is local to one process"
        )
    from ragblend.serving.affinity import DEFAULT_LOAD_BOUND
    from ragblend.serving.ray_replica import ReplicaSettings

    keys = checked_keys(args)
    cpus = 1.0 if args.replica_cpus is None else args.replica_cpus
    settings = ReplicaSettings(
        model=args.model,
        redis_url=args.redis_url,
        config=config_fields(args),
        namespace=args.namespace,
        ram_bytes=args.ram_bytes,
        threads=max(1, int(cpus)),
        model_names=model_names(args),
        api_keys=tuple(keys),
        max_running=args.max_running,
        max_queue=args.max_queue,
        max_tokens=args.max_tokens,
        timeout_s=args.timeout,
        allowed_origins=tuple(origins(args.allowed_origins)),
    )
    from ragblend.serving.ray_serve import RayOptions, serve_forever

    options = RayOptions(
        replicas=2 if args.replicas is None else args.replicas,
        replica_cpus=cpus,
        replica_gpus=1.0 if str(args.device).startswith("cuda") else 0.0,
        routing=args.routing or "chunk",
        load_bound=DEFAULT_LOAD_BOUND if args.route_load_bound is None else args.route_load_bound,
    )
    options.check()
    return serve_forever(settings, options, address=args.ray, host=args.host, port=args.port)
