"""``kvtrio serve``: mlx-lm's OpenAI-compatible server with a prompt cache that survives restarts.

mlx_lm.server's own HTTP server (``APIHandler`` on a ``ThreadingHTTPServer``), its
``ModelProvider`` and its ``ResponseGenerator`` (generation thread, batching, chat
templates, tool calls, sampling), with :class:`~kvtrio.serve.adapter.TieredLRUPromptCache`
in place of LRUPromptCache. It takes mlx_lm.server's flags unchanged (read from the
installed mlx_lm.server, so they follow its version) plus kvtrio's.

Theory of operation:

1. Threads: mlx-lm's generation thread is the MLX owner. It binds the tier's executor
   before its loop starts and pumps the tier's MLX jobs (snapshots, materialization,
   load buffers) whenever it looks for a new request, so a save costs it only those
   short jobs, never a wait for the disk. Jobs queued while it sleeps wake it up; jobs
   queued while it decodes a batch end the batch's time slice after the current step
   (:class:`_PumpingBudget`), so they run between model steps.
2. Which tier served a request: the adapter records each lookup; the request's response
   queue, wrapped when the generation thread takes the request, tags the request's
   context with the first lookup made after that (mlx-lm's loop looks the request up
   right after taking it). The handler waits for the tag before it sends its headers and
   sends ``X-Kvtrio-Cache: hot|cold|miss`` and ``X-Kvtrio-Cached-Tokens``.
   ``usage.prompt_tokens_details.cached_tokens`` is mlx-lm's count of reused tokens, from
   either tier.
3. A cold load blocks only the request that needs it: when the generation thread takes a
   request whose prompt disk serves better than RAM, it sets the request aside, starts
   the load (the adapter's ``prefetch``) and goes on with the others; the load's MLX jobs
   run between their steps, and once the entry is in RAM the request is taken again
   (its lookup a RAM hit, reported as ``cold``). A load outliving
   ``--cold-load-timeout`` releases the request anyway (a recompute).
4. Shutdown (first SIGTERM or SIGINT): stop accepting (the listener closes), let requests
   in flight finish for ``--grace`` seconds, then cut the rest (each stops at its next
   step) and give them ``--grace`` more; stop the generation thread, which writes every
   RAM entry to disk (the tier drains its queue within the same grace) and ends; exit 0.
   A second signal exits at once with status 1: every file is published by rename after
   fsync, so nothing on disk is torn (a tmp file at worst, removed by the next start).
   At exit it prints the disk's wear: bytes written, read, read back, and admissions.
5. ``GET /metrics``: Prometheus text (format 0.0.4) of the RAM tier's lookups and the
   cold tier's families (``TieredPromptCache.metrics_text``, read on the tier's loop
   thread; docs/metrics.md names them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import socket
import threading
import time
import types
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from queue import Queue
from typing import Any

import attrs
from kvtrio.actors.callerchecks import DEFAULT_MIN_REUSE_TOKENS
from kvtrio.actors.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from kvtrio.actors.owner import release_thread_streams
from kvtrio.actors.prefix import ModelKey
from kvtrio.serve.adapter import CacheTier, FetchInfo, TieredLRUPromptCache
from kvtrio.serve.bridge import TierOptions, TierThread
from kvtrio.storage.fingerprint import config_fingerprint

__all__ = [
    "CACHE_HEADER",
    "CACHED_TOKENS_HEADER",
    "ServeOptions",
    "add_kvtrio_arguments",
    "add_mlx_server_arguments",
    "mlx_server_parser",
    "serve",
]

logger = logging.getLogger(__name__)

CACHE_HEADER = "X-Kvtrio-Cache"
CACHED_TOKENS_HEADER = "X-Kvtrio-Cached-Tokens"
# GET: the Prometheus text of the RAM tier and the cold tier (docs/serve.md, docs/metrics.md).
METRICS_PATH = "/metrics"
# Tokens per model call when --warm-prompts prefills a prompt.
WARM_STEP = 512

#: Seconds a handler waits for its request's lookup before sending headers without it.
TAG_WAIT = 120.0


# -- flags -----------------------------------------------------------------------------


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser captured")
        self.parser = parser


class _CapturingParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["add_help"] = False
        super().__init__(*args, **kwargs)

    def parse_args(self, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(self)


def mlx_server_parser() -> argparse.ArgumentParser:
    """mlx_lm.server's own argument parser (without -h), taken from its ``main`` as
    installed: its ``parse_args`` call hands the parser back instead of parsing."""
    mlx_server = _mlx_server()
    shim = types.SimpleNamespace(**vars(argparse))
    shim.ArgumentParser = _CapturingParser
    saved = mlx_server.argparse
    mlx_server.argparse = shim
    try:
        mlx_server.main()
    except _Captured as captured:
        return captured.parser
    finally:
        mlx_server.argparse = saved
    raise RuntimeError("mlx_lm.server.main() built no argument parser")


def add_mlx_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every flag of mlx_lm.server to ``parser``, unchanged."""
    parser._add_container_actions(mlx_server_parser())


def _size(text: str) -> int:
    from mlx_lm import utils

    parse: Any = utils._parse_size
    return int(parse(text))


def add_kvtrio_arguments(parser: argparse.ArgumentParser, *, default_cache_dir: Path) -> None:
    """kvtrio's own flags (see docs/serve.md)."""
    group = parser.add_argument_group("kvtrio")
    group.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir,
        help="the cold tier's directory (default: the user cache directory)",
    )
    group.add_argument(
        "--redis",
        metavar="URL",
        default=None,
        help="a redis:// URL: keep the cold tier in Redis, shared by several hosts",
    )
    group.add_argument(
        "--hot-bytes",
        type=_size,
        default=None,
        help="RAM budget of the prompt cache (default: mlx-lm's, --prompt-cache-size only)",
    )
    group.add_argument(
        "--cold-bytes", type=_size, default=8 << 30, help="disk budget (default: 8 GiB)"
    )
    group.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds for requests in flight at shutdown, and again for the disk writes",
    )
    group.add_argument(
        "--cold-load-timeout",
        type=float,
        default=30.0,
        help="a disk load taking longer is a miss for its request (seconds)",
    )
    group.add_argument(
        "--min-reuse-tokens",
        type=int,
        default=DEFAULT_MIN_REUSE_TOKENS,
        help="a disk entry reusing fewer tokens is not loaded: recomputing them is faster "
        f"(default {DEFAULT_MIN_REUSE_TOKENS}, measured: docs/tiered.md)",
    )
    group.add_argument(
        "--warm-prompts",
        type=Path,
        default=None,
        metavar="FILE",
        help="prefill each line of FILE (a text prompt) at start and store it on disk, "
        "skipping prompts already there",
    )


@attrs.frozen
class ServeOptions:
    """kvtrio's part of ``kvtrio serve``'s options."""

    cache_dir: str
    hot_bytes: int | None = None
    cold_bytes: int = 8 << 30
    grace: float = 10.0
    cold_load_timeout: float = 30.0
    min_reuse_tokens: int = DEFAULT_MIN_REUSE_TOKENS

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeOptions:
        return cls(
            cache_dir=args.redis or os.fspath(args.cache_dir),
            hot_bytes=args.hot_bytes,
            cold_bytes=args.cold_bytes,
            grace=args.grace,
            cold_load_timeout=args.cold_load_timeout,
            min_reuse_tokens=args.min_reuse_tokens,
        )


def model_identity(args: argparse.Namespace) -> ModelKey:
    """The tier's model key: the model argument, and a fingerprint of its config, its
    weight files (names and sizes), adapter, draft model and KV quantization."""
    from mlx_lm.utils import _download

    path = Path(args.model)
    if not path.exists():
        path = Path(_download(args.model))
    config = json.loads((path / "config.json").read_text())
    weights = hashlib.sha256()
    for item in sorted(path.glob("*.safetensors")):
        weights.update(f"{item.name}:{item.stat().st_size};".encode())
    weights.update(f"adapter={args.adapter_path};draft={args.draft_model}".encode())
    fingerprint = config_fingerprint(
        config,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size if args.kv_bits else None,
        quantized_kv_start=args.quantized_kv_start if args.kv_bits else None,
        weights_id=weights.hexdigest(),
    )
    return ModelKey(str(args.model), fingerprint)


# -- the generation thread -------------------------------------------------------------


def _mlx_server() -> Any:
    from mlx_lm import server

    return server


_WAKE = object()  # a request-queue item: the tier queued MLX jobs (rule 1)


@attrs.define(eq=False)
class _Tag:
    """Which tier served a request (rule 2); ``ready`` once known."""

    ready: threading.Event = attrs.field(factory=threading.Event)
    fetch: FetchInfo | None = None


class _TaggingQueue:
    """A request's response queue, as the generation thread sees it (rule 2)."""

    def __init__(
        self, inner: Queue[Any], adapter: TieredLRUPromptCache, *, from_disk: bool = False
    ) -> None:
        self.inner = inner
        self.adapter = adapter
        self.from_disk = from_disk  # its entry was loaded for it: a RAM hit is a disk hit
        self.start = adapter.fetch_count
        self.tag: _Tag | None = None
        self.tagged = False

    def put(self, item: Any, *args: Any, **kwargs: Any) -> None:
        if self.tag is None and isinstance(item, _mlx_server().GenerationContext):
            self.tag = _Tag()
            item.kvtrio = self.tag
        if not self.tagged and self.adapter.fetch_count > self.start and self.tag is not None:
            self.tagged = True
            fetch = self.adapter.last_fetch
            if self.from_disk and fetch is not None and fetch.tier is CacheTier.HOT:
                fetch = FetchInfo(CacheTier.COLD, fetch.reused)
            self.tag.fetch = fetch
            self.tag.ready.set()
        self.inner.put(item, *args, **kwargs)

    def get(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.get(*args, **kwargs)


def _pumping_budget(adapter: TieredLRUPromptCache) -> Any:
    base = _mlx_server().TimeBudget

    class PumpingBudget(base):  # type: ignore[misc,valid-type]
        """mlx-lm's decode time slice, ended early (after one step at least) when the tier
        has MLX jobs queued (rule 1)."""

        def __iter__(self) -> Any:
            self._kvtrio_steps = 0
            return super().__iter__()

        def __next__(self) -> Any:
            self._kvtrio_steps += 1
            if self._kvtrio_steps > 1 and adapter.tier is not None and adapter.tier.pending():
                raise StopIteration
            return super().__next__()

    return PumpingBudget()


def warm_prompts(provider: Any, adapter: TieredLRUPromptCache, path: Path) -> tuple[int, int]:
    """Generation thread (the MLX owner): prefill each non-empty line of ``path`` (a text
    prompt, tokenized as ``/v1/completions`` does, less its last token) and hand it to
    the cold tier as a flush (written whatever the admission policy says); a prompt whose
    exact entry is on disk already is skipped. (stored, skipped); the writes finish in
    the background."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = provider.load("default_model")
    key = provider.model_key
    stored = skipped = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        text = line.strip()
        tier = adapter.tier
        if not text or tier is None or not tier.alive or tier.cache is None:
            continue
        if key != adapter.tier_model:
            logger.warning("kvtrio serve: warm prompts skipped: the model is not the tier's")
            break
        # All but the last token: a request of this prompt still has one to process (an
        # exact hit would leave mlx-lm's batch an empty prompt), and reuses the rest.
        tokens = [int(t) for t in tokenizer.encode(text)][:-1]
        if not tokens:
            continue
        cold = tier.cache
        match = tier.peek(cold.peek, tokens)
        if match is not None and match.reuse == len(tokens) and not match.trim:
            skipped += 1
            continue
        caches = make_prompt_cache(model)
        for start in range(0, len(tokens), WARM_STEP):
            model(mx.array(tokens[start : start + WARM_STEP])[None], cache=caches)
            mx.eval([c.state for c in caches])
        if tier.submit(_flush_spill, cold, tokens, caches):
            stored += 1
        adapter.pump()
    return stored, skipped


async def _flush_spill(cold: Any, tokens: list[int], caches: list[Any]) -> None:
    await cold.spill(tokens, caches, meta={"mlx_lm.cache_type": "assistant"}, flush=True)


def _generator_class() -> type:
    server = _mlx_server()

    class KvtrioResponseGenerator(server.ResponseGenerator):  # type: ignore[misc,name-defined]
        """mlx-lm's ResponseGenerator whose generation thread owns kvtrio's tier."""

        prompt_cache: TieredLRUPromptCache

        def __init__(self, model_provider: Any, prompt_cache: TieredLRUPromptCache) -> None:
            self.adapter = prompt_cache
            self.active: dict[int, Any] = {}  # id(ctx) -> ctx (contexts are unhashable)
            self._active_lock = threading.Lock()
            self._wake_pending = threading.Event()
            self.closed_in_time: bool | None = None
            self._local = threading.local()
            # Requests set aside while their disk entry loads (rule 3), and those released.
            self._deferred: dict[object, Any] = {}
            self._deferred_since: dict[object, float] = {}
            self._ready: list[tuple[Any, bool]] = []
            if prompt_cache.tier is not None:
                prompt_cache.tier.executor.on_queued = self._wake
            super().__init__(model_provider, prompt_cache)

        # generation thread

        def _wake(self) -> None:
            if not self._wake_pending.is_set():
                self._wake_pending.set()
                self.requests.put(_WAKE)

        def _generate(self) -> None:
            adapter = self.adapter
            if adapter.tier is not None:
                adapter.tier.bind()
            self._time_budget = _pumping_budget(adapter)
            try:
                warm = getattr(self.cli_args, "warm_prompts", None)
                if warm is not None:
                    stored, skipped = warm_prompts(self.model_provider, adapter, Path(warm))
                    print(
                        f"kvtrio serve: warm prompts stored {stored}, already on disk {skipped}",
                        flush=True,
                    )
                super()._generate()
            finally:
                grace = float(getattr(self.cli_args, "grace", 10.0))
                try:
                    self.closed_in_time = adapter.close(timeout=grace * 2 + 5)
                finally:
                    # MLX's per-thread streams must end with their thread, not at exit.
                    release_thread_streams()

        def _next_request(self, timeout: float | None = None) -> Any:
            self.adapter.pump()
            ready = self._take_ready()
            if ready is not None:
                return ready
            request = super()._next_request(timeout)
            if request is _WAKE:
                self._wake_pending.clear()
                self.adapter.pump()
                return self._take_ready()
            if request is None or self._defer(request):
                return None
            rqueue, body, args = request
            return _TaggingQueue(rqueue, self.adapter), body, args

        def _defer(self, request: Any) -> bool:
            """Rule 3: set a request aside while its disk entry loads; True if it was."""
            _, body, args = request
            provider = self.model_provider
            model = args.model
            key = (
                provider._model_map.get(model.model, model.model),
                provider._adapter_map.get(model.model, model.adapter),
                provider._draft_model_map.get(model.draft, model.draft),
            )
            if key != self.adapter.tier_model or provider.tokenizer is None:
                return False
            if any(server._image_parts(body.messages)):
                return False
            try:
                prompt = self._tokenize(provider.tokenizer, body, args)[0]
            except Exception:
                return False  # mlx-lm's loop reports it
            token = object()

            def done(loaded: bool) -> None:
                if self._deferred.pop(token, None) is not None:
                    self._ready.append((request, loaded))

            self._deferred[token] = request
            self._deferred_since[token] = time.monotonic()
            if not self.adapter.prefetch(key, prompt, done):
                self._deferred.pop(token, None)
                self._deferred_since.pop(token, None)
                return False
            return True

        def _take_ready(self) -> Any:
            now = time.monotonic()
            limit = self.adapter.load_timeout
            for token, since in list(self._deferred_since.items()):
                if token not in self._deferred:
                    del self._deferred_since[token]
                elif now - since > limit:  # the load outlived its timeout: serve anyway
                    del self._deferred_since[token]
                    self._ready.append((self._deferred.pop(token), False))
            if not self._ready:
                return None
            (rqueue, body, args), loaded = self._ready.pop(0)
            return _TaggingQueue(rqueue, self.adapter, from_disk=loaded), body, args

        # handler threads

        def generate(
            self, request: Any, generation_args: Any, progress_callback: Any = None
        ) -> Any:
            ctx, response = super().generate(request, generation_args, progress_callback)
            self._local.ctx = ctx
            with self._active_lock:
                self.active[id(ctx)] = ctx
            return ctx, self._track(ctx, response)

        def _track(self, ctx: Any, response: Iterator[Any]) -> Iterator[Any]:
            try:
                yield from response
            finally:
                with self._active_lock:
                    self.active.pop(id(ctx), None)
                self._local.ctx = None

        def current_tag(self) -> _Tag | None:
            ctx = getattr(self._local, "ctx", None)
            return getattr(ctx, "kvtrio", None) if ctx is not None else None

        def cut_all(self) -> int:
            """Ask every request in flight to stop at its next step (shutdown)."""
            with self._active_lock:
                active = list(self.active.values())
            for ctx in active:
                ctx.stop()
            return len(active)

    return KvtrioResponseGenerator


def _handler_class() -> type:
    server = _mlx_server()

    class KvtrioHandler(server.APIHandler):  # type: ignore[misc,name-defined]
        """mlx-lm's APIHandler, sending which tier served the request (rule 2)."""

        def _kvtrio_headers(self) -> None:
            # The context was tagged before the handler got it; the lookup may still run.
            tag = self.response_generator.current_tag()
            if tag is None or not tag.ready.wait(TAG_WAIT):
                return
            fetch = tag.fetch
            tier = fetch.tier if fetch is not None else CacheTier.MISS
            self.send_header(CACHE_HEADER, tier.value)
            self.send_header(CACHED_TOKENS_HEADER, str(fetch.reused if fetch else 0))

        def _set_completion_headers(self, status_code: int = 200) -> None:
            super()._set_completion_headers(status_code)
            if status_code == 200:
                self._kvtrio_headers()

        def _set_stream_headers(self, status_code: int = 200) -> None:
            super()._set_stream_headers(status_code)
            if status_code == 200:
                self._kvtrio_headers()

        def do_POST(self) -> None:
            tracker: _InFlight = self.server.kvtrio_in_flight
            with tracker:
                super().do_POST()

        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != METRICS_PATH:
                super().do_GET()
                return
            adapter: TieredLRUPromptCache = self.server.kvtrio_adapter
            body = adapter.metrics_text().encode()
            self.send_response(200)
            self.send_header("Content-Type", METRICS_CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return KvtrioHandler


@attrs.define(eq=False)
class _InFlight:
    """Requests being handled (shutdown waits for them)."""

    count: int = 0
    lock: threading.Condition = attrs.field(factory=threading.Condition)

    def __enter__(self) -> None:
        with self.lock:
            self.count += 1

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.count -= 1
            self.lock.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        with self.lock:
            return self.lock.wait_for(lambda: self.count == 0, timeout)


# -- the server ------------------------------------------------------------------------


def _http_server(host: str, port: int, generator: Any) -> ThreadingHTTPServer:
    server = _mlx_server()
    handler = _handler_class()
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = next(iter(infos))

    class Server(ThreadingHTTPServer):
        address_family = family
        daemon_threads = True

    fingerprint = server.get_system_fingerprint()
    httpd = Server(
        address,  # type: ignore[arg-type]
        lambda *a, **k: handler(generator, *a, system_fingerprint=fingerprint, **k),
    )
    httpd.kvtrio_in_flight = _InFlight()  # type: ignore[attr-defined]
    return httpd


def serve(args: argparse.Namespace) -> int:
    """Run ``kvtrio serve`` until SIGTERM/SIGINT (rule 4); the exit status."""
    import mlx.core as mx

    server = _mlx_server()
    if mx.distributed.init().size() > 1:
        raise SystemExit("kvtrio serve: distributed runs are not supported")
    if str(args.model).endswith(".gguf"):  # converted once, beside the cold tier's files
        from kvtrio.serve.gguf import gguf_model_dir

        args.model = str(gguf_model_dir(args.model, Path(args.cache_dir) / "gguf"))
    options = ServeOptions.from_args(args)
    tier = TierThread(
        TierOptions(
            options.cache_dir,
            model_identity(args),
            cold_budget=options.cold_bytes,
            shutdown_grace=options.grace,
            min_reuse_tokens=options.min_reuse_tokens,
        )
    )
    tier.start()
    adapter = TieredLRUPromptCache(
        args.prompt_cache_size,
        options.hot_bytes if options.hot_bytes is not None else 1 << 63,
        tier=tier,
        tier_model=(args.model, args.adapter_path, args.draft_model),
        load_timeout=options.cold_load_timeout,
        load_in_lookup=False,  # rule 3: a request disk serves better is set aside instead
    )
    provider = server.ModelProvider(args)
    generator = _generator_class()(provider, adapter)
    httpd = _http_server(args.host, args.port, generator)
    httpd.kvtrio_adapter = adapter  # type: ignore[attr-defined]
    stopping = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if stopping.is_set():
            os._exit(1)  # second signal: at once (rule 4)
        stopping.set()
        threading.Thread(target=httpd.shutdown, name="kvtrio-stop", daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    host, port = str(httpd.server_address[0]), httpd.server_address[1]
    logger.info("kvtrio serve: cold tier at %s", options.cache_dir)
    print(f"kvtrio serve: listening on {host}:{port}", flush=True)
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
    in_flight: _InFlight = httpd.kvtrio_in_flight  # type: ignore[attr-defined]
    if not in_flight.wait_idle(options.grace):
        logger.info("kvtrio serve: cutting %d requests after the grace", generator.cut_all())
        in_flight.wait_idle(options.grace)
    generator.stop_and_join()
    stats = adapter.statistics()
    print(
        f"kvtrio serve: stopped (RAM entries written: {stats.spilled}, "
        f"hot hits {stats.hits_hot}, cold hits {stats.hits_cold}, misses {stats.misses}, "
        f"disk loads set aside {stats.prefetches})",
        flush=True,
    )
    wear = adapter.wear()
    if wear is not None:
        print(
            f"kvtrio serve: disk wear (bytes written {wear.bytes_written}, "
            f"bytes read {wear.bytes_read}, bytes read back {wear.bytes_reused}, "
            f"reuse ratio {wear.reuse_ratio:.3f}, admitted {wear.admitted}, "
            f"refused {wear.refused}, bytes refused {wear.bytes_refused})",
            flush=True,
        )
    return 0 if generator.closed_in_time else 1
