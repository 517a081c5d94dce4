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
   request whose prompt disk serves better than RAM while other requests are in flight,
   it sets the request aside, starts
   the load (the adapter's ``prefetch``) and goes on with the others; the load's MLX jobs
   run between their steps, and once the entry is in RAM the request is taken again
   (its lookup a RAM hit, reported as ``cold``; a decode time slice ends after its
   current step when such a request is ready). A load outliving
   ``--cold-load-timeout`` releases the request anyway (a recompute). With no other
   request in flight there is nobody to serve meanwhile: the lookup waits for the load
   (adopting the prefetch, rule 7), fewer hand-offs than setting the request aside.
4. Shutdown (first SIGTERM or SIGINT): stop accepting (the listener closes), let requests
   in flight finish for ``--grace`` seconds, then cut the rest (each stops at its next
   step, and its reply ends there: :func:`~kvtrio.serve.tagging.end_response`) and give
   them ``--grace`` more; stop the generation thread, which writes every
   RAM entry to disk within the stated deadline (``--flush-timeout``, by default growing
   with the bytes: :mod:`kvtrio.serve.flushreport`) and ends; exit 0 when every entry
   is on disk (1 past the deadline or when a write failed, each entry not written named
   at exit: the flush report's rule 4).
   A second signal exits at once with status 1: every file is published by rename after
   fsync, so nothing on disk is torn (a tmp file at worst, removed by the next start).
   At exit it prints the disk's wear: bytes written, read, read back, and admissions.
5. ``GET /metrics``: Prometheus text (format 0.0.4) of the RAM tier's lookups and the
   cold tier's families (``TieredPromptCache.metrics_text``, read on the tier's loop
   thread; docs/metrics.md names them).
6. Start: the listener opens and the model loads as in mlx-lm; then, as soon as no
   request is in flight (none arrived and unanswered: waiting, prefilling or decoding;
   at most ``OPEN_DEFER`` seconds after the first answer), the cold tier opens on a thread of
   its own (:mod:`kvtrio.serve.coldopen`; the tier's modules are imported there too, and
   serve/flags.py imports none), so the server answers before the index is built, and
   the first requests do not share the GIL with the open (:func:`open_now`). A request
   looked up before that is RAM's answer, counted
   (``kvtrio_serve_cold_unavailable_total{reason="opening"}``);
   ``kvtrio_serve_cold_ready`` says when the tier is there, and the server prints
   ``cold tier ready``. A tier that cannot open, or a model that does not load
   (:class:`~kvtrio.serve.lifecycle.ModelLoad`), stops the server (exit status 2).
7. Prefetch on arrival: the HTTP handler thread tokenizes its request (mlx-lm's
   tokenization) and asks the adapter to start the disk load
   (``TieredLRUPromptCache.prefetch_on_arrival``) before it queues the request for the
   generation thread, so the load overlaps the queue wait; rule 3 then adopts it.
   ``--no-prefetch`` turns rules 3 and 7 off: a disk load starts when the generation
   thread looks the request up, and that thread waits for it.
8. Decoding comes first: while a batch is in flight the generation thread runs one owner
   job between two decode steps (a pump of budget 0), and tells the tier it decodes
   (``TierThread.set_foreground``): a write-back of an evicted entry then waits to start
   until the batch is done, for at most ``--write-defer`` seconds, or less when the
   pending writes reach half of their byte cap (:mod:`kvtrio.actors.writegate`).
9. Warm restart: once the tier is open, while no request is in flight, the generation
   thread loads recent disk entries back into RAM, one at a time (:mod:`.restore`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
import types
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtrio.serve.adapter import CacheTier, TieredLRUPromptCache
from kvtrio.serve.coldopen import ColdOpening, ServeCache, open_now
from kvtrio.serve.flags import (
    ServeOptions,
    add_kvtrio_arguments,
    add_mlx_server_arguments,
    mlx_server_parser,
    model_identity,
)
from kvtrio.serve.flushreport import flush_deadline, print_exit
from kvtrio.serve.lifecycle import InFlight, ModelLoad
from kvtrio.serve.restore import Restore
from kvtrio.serve.steps import between_steps, pumping_budget
from kvtrio.serve.tagging import Tag, TaggingQueue, end_response

if TYPE_CHECKING:  # the tier's modules are imported by the thread that opens it (rule 6)
    from kvtrio.serve.bridge import TierThread

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

#: Requests tokenized by their handler and not yet taken, kept for the generation thread.
TOKENIZED_KEPT = 256

#: Seconds a handler waits for its request's lookup before sending headers without it.
TAG_WAIT = 120.0


# -- the generation thread -------------------------------------------------------------


def _mlx_server() -> Any:
    from mlx_lm import server

    return server


_WAKE = object()  # a request-queue item: the tier queued MLX jobs (rule 1)


def _copied(tokenized: Any) -> Any:
    """A copy of mlx-lm's ``_tokenize`` result whose lists its loop may edit."""
    prompt, segments, segment_types, initial_state, vision = tokenized
    return list(prompt), [list(x) for x in segments], list(segment_types), initial_state, vision


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
            self.in_flight = 0  # requests arrived (generate()) and not yet answered (rule 6)
            self._wake_pending = threading.Event()
            self.closed_in_time: bool | None = None
            self.model_load = ModelLoad()
            self.prefetching = bool(getattr(model_provider.cli_args, "prefetch", True))
            self._open_pending = False  # the model has loaded, the tier's open not started
            self._first_answer: float | None = None  # when a request was first answered
            # Requests tokenized by their handler (rule 7), for the generation thread.
            self._tokenized: OrderedDict[int, tuple[Any, Any, Any]] = OrderedDict()
            self._tokenized_lock = threading.Lock()
            self._local = threading.local()
            # Requests set aside while their disk entry loads (rule 3), and those released.
            self._deferred: dict[object, Any] = {}
            self._deferred_since: dict[object, float] = {}
            self._ready: list[tuple[Any, bool]] = []
            idle = lambda: self.in_flight == 0 and not self._busy() and not self._ready  # noqa: E731
            self._restore = Restore.of(prompt_cache, model_provider, idle)  # rule 9
            if prompt_cache.tier is not None:
                prompt_cache.tier.executor.on_queued = self._wake
            if isinstance(prompt_cache, ServeCache):  # the tier comes later (rule 6)
                prompt_cache.on_attach = self._on_attach
            super().__init__(model_provider, prompt_cache)

        # generation thread

        def _wake(self) -> None:
            if not self._wake_pending.is_set():
                self._wake_pending.set()
                self.requests.put(_WAKE)

        def _start_open(self) -> None:
            """Start the cold tier's open, once (rule 6)."""
            if self._open_pending and isinstance(self.adapter, ServeCache):
                self._open_pending = False
                self.adapter.opening.start()

        def _on_attach(self, tier: TierThread) -> None:
            tier.executor.on_queued = self._wake
            if tier.pending():
                self._wake()

        def _generate(self) -> None:
            adapter = self.adapter
            if adapter.tier is not None:
                adapter.tier.bind()
            self._time_budget = pumping_budget(adapter, lambda: bool(self._ready))
            failure: Exception | None = None
            if isinstance(adapter, ServeCache):  # rule 6: the model first, then the tier
                try:
                    self.model_provider.load_default()  # mlx-lm's loop then finds it loaded
                except Exception as exc:  # serve() stops the server (rule 6), in one line
                    logger.debug("kvtrio serve: the model did not load", exc_info=True)
                    failure = exc
                self._open_pending = True
            self.model_load.ended(failure)
            try:
                if failure is not None:  # mlx-lm's loop would load it again, and die of it
                    return
                warm = getattr(self.cli_args, "warm_prompts", None)
                if warm is not None:
                    if isinstance(adapter, ServeCache):  # warm prompts need the tier
                        self._start_open()
                        adapter.opening.done.wait()
                        adapter.attach()
                    stored, skipped = warm_prompts(self.model_provider, adapter, Path(warm))
                    print(
                        f"kvtrio serve: warm prompts stored {stored}, already on disk {skipped}",
                        flush=True,
                    )
                super()._generate()
            finally:
                deadline = flush_deadline(
                    float(getattr(self.cli_args, "grace", 10.0)),
                    adapter.nbytes,
                    getattr(self.cli_args, "flush_timeout", None),
                )
                print(
                    f"kvtrio serve: writing {len(adapter)} RAM entries ({adapter.nbytes} "
                    f"bytes) to disk, deadline {deadline:.1f}s",
                    flush=True,
                )
                try:
                    self.closed_in_time = adapter.close(timeout=deadline)
                finally:
                    from kvtrio.actors.owner import release_thread_streams

                    # MLX's per-thread streams must end with their thread, not at exit.
                    release_thread_streams()

        def _next_request(self, timeout: float | None = None) -> Any:
            decoding, budget = between_steps(timeout)
            if self.adapter.tier is not None:
                self.adapter.tier.set_foreground(decoding)
            self.adapter.pump(budget)
            ready = self._take_ready()
            if ready is not None:
                self._set_lookup_mode(self._busy())  # in RAM by now; if not, load only when alone
                return ready
            tier = self.adapter.tier
            if timeout is not None and tier is not None and tier.pending():
                timeout = None  # jobs left after the pump's budget: do not sleep on them
            self._restore.step()  # rule 9: only when idle
            request = super()._next_request(timeout)
            if self._open_pending and open_now(
                request_taken=request is not None,
                in_flight=self.in_flight,
                now=time.monotonic(),
                first_answer=self._first_answer,
            ):
                self._start_open()  # rule 6: none in flight (or OPEN_DEFER after an answer)
            while request is _WAKE:
                self._wake_pending.clear()
                self.adapter.pump(budget)
                self._restore.step()  # the tier may have just opened (rule 9)
                ready = self._take_ready()
                if ready is not None:
                    self._set_lookup_mode(self._busy())
                    return ready
                # A request queued behind the wake-up is taken now, not after the next
                # decode time slice (up to 0.5 s) that returning here would start.
                request = super()._next_request(None)
            if request is None or self._defer(request):
                return None
            rqueue, body, args = request
            return TaggingQueue(rqueue, self.adapter), body, args

        def _tokenize(self, tokenizer: Any, request: Any, args: Any) -> Any:
            """mlx-lm's tokenization, run once per request: what the request's handler
            computed (rule 7) is used, and forgotten, here."""
            known = self._known_tokens(tokenizer, request, forget=True)
            return known if known is not None else super()._tokenize(tokenizer, request, args)

        def _known_tokens(self, tokenizer: Any, request: Any, *, forget: bool) -> Any:
            """A copy (mlx-lm's loop edits the segments) of the handler's tokenization of
            ``request`` by ``tokenizer``, or None."""
            with self._tokenized_lock:
                known = self._tokenized.get(id(request))
                if known is None or known[0] is not request or known[1] is not tokenizer:
                    return None
                if forget:
                    del self._tokenized[id(request)]
            return _copied(known[2])

        def _tier_prompt(
            self, body: Any, args: Any, *, remember: bool = False
        ) -> tuple[Hashable, list[int]] | None:
            """The model key and prompt tokens of a request of the tier's model (mlx-lm's
            tokenization, kept for the generation thread if ``remember``), or None
            (another model, images, no tokenizer yet, an error: mlx-lm's loop reports
            it). Any thread."""
            provider = self.model_provider
            model = args.model
            key = (
                provider._model_map.get(model.model, model.model),
                provider._adapter_map.get(model.model, model.adapter),
                provider._draft_model_map.get(model.draft, model.draft),
            )
            tokenizer = provider.tokenizer
            if key != self.adapter.tier_model or tokenizer is None:
                return None
            if any(server._image_parts(body.messages)):
                return None
            result = self._known_tokens(tokenizer, body, forget=False)
            if result is None:
                try:
                    result = super()._tokenize(tokenizer, body, args)
                except Exception:
                    return None
                if remember and result[4] is None:
                    with self._tokenized_lock:
                        self._tokenized[id(body)] = (body, tokenizer, _copied(result))
                        while len(self._tokenized) > TOKENIZED_KEPT:
                            self._tokenized.popitem(last=False)
            return key, list(result[0])

        def _busy(self) -> bool:
            """Other requests are in flight (or set aside): a lookup must not make them
            wait on a disk load (rule 3)."""
            with self._active_lock:
                return bool(self.active) or bool(self._deferred)

        def _set_lookup_mode(self, busy: bool) -> None:
            """Rule 3, per lookup: the adapter's lookup loads from disk only when nobody
            else waits on this thread (or ``--no-prefetch``: there is no setting aside)."""
            self.adapter.load_in_lookup = not (self.prefetching and busy)

        def _defer(self, request: Any) -> bool:
            """Rule 3: set a request aside while its disk entry loads; True if it was."""
            busy = self._busy()
            self._set_lookup_mode(busy)
            if not self.prefetching:
                return False
            if not busy:  # nobody else to serve: the lookup waits for the load (faster)
                return False
            _, body, args = request
            self.adapter.pump(0)  # takes a tier that has just opened (rule 6)
            found = self._tier_prompt(body, args)
            if found is None:
                return False
            key, prompt = found
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
            return TaggingQueue(rqueue, self.adapter, from_disk=loaded), body, args

        # handler threads

        def generate(
            self, request: Any, generation_args: Any, progress_callback: Any = None
        ) -> Any:
            with self._active_lock:
                self.in_flight += 1
            try:
                if self.prefetching:  # rule 7: the disk load starts as the request arrives
                    found = self._tier_prompt(request, generation_args, remember=True)
                    if found is not None:
                        self.adapter.prefetch_on_arrival(*found)
                ctx, response = super().generate(request, generation_args, progress_callback)
            except BaseException:
                self._answered()
                raise
            self._local.ctx = ctx
            with self._active_lock:
                self.active[id(ctx)] = ctx
            return ctx, self._track(ctx, response)

        def _answered(self) -> None:
            with self._active_lock:
                self.in_flight -= 1
                if self._first_answer is None:  # rule 6: the open's deadline counts from here
                    self._first_answer = time.monotonic()

        def _track(self, ctx: Any, response: Iterator[Any]) -> Iterator[Any]:
            try:
                yield from response
            finally:
                with self._active_lock:
                    self.active.pop(id(ctx), None)
                self._answered()
                self._local.ctx = None

        def current_tag(self) -> Tag | None:
            ctx = getattr(self._local, "ctx", None)
            return getattr(ctx, "kvtrio", None) if ctx is not None else None

        def cut_all(self) -> int:
            """Ask every request in flight to stop at its next step (shutdown)."""
            with self._active_lock:
                active = list(self.active.values())
            for ctx in active:
                ctx.stop()
                end_response(ctx)  # mlx-lm's batched loop ends no stopped request (rule 4)
            return len(active)

    return KvtrioResponseGenerator


def _models_listed_without_a_hub_cache(server: Any) -> None:
    """mlx-lm's ``GET /v1/models`` lists the models of the Hugging Face cache, and its scan
    raises ``CacheNotFound`` where that cache does not exist (a local or GGUF model,
    nothing ever downloaded): the handler died after its 200 header, the client got an
    empty body (the ``openai`` client a JSONDecodeError), the server log a traceback. No
    cache directory lists no downloaded model; the ``--model`` directory is still listed."""
    from huggingface_hub.errors import CacheNotFound

    scan = server.scan_cache_dir
    if getattr(scan, "kvtrio_tolerant", False):
        return

    def scan_cache_dir(*args: Any, **kwargs: Any) -> Any:
        try:
            return scan(*args, **kwargs)
        except CacheNotFound:
            return types.SimpleNamespace(repos=frozenset())

    scan_cache_dir.kvtrio_tolerant = True  # type: ignore[attr-defined]
    server.scan_cache_dir = scan_cache_dir


def _handler_class() -> type:
    server = _mlx_server()
    _models_listed_without_a_hub_cache(server)

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
            tracker: InFlight = self.server.kvtrio_in_flight
            with tracker:
                try:
                    super().do_POST()
                except (BrokenPipeError, ConnectionResetError) as exc:  # the client left
                    logger.info(
                        "kvtrio serve: client %s left mid-response (%s)",
                        self.client_address[0],
                        type(exc).__name__,
                    )
                    self.close_connection = True

        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != METRICS_PATH:
                super().do_GET()
                return
            from kvtrio.actors.metrics import CONTENT_TYPE

            adapter: TieredLRUPromptCache = self.server.kvtrio_adapter
            body = adapter.metrics_text().encode()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return KvtrioHandler


# -- the server ------------------------------------------------------------------------


def _http_server(host: str, port: int, generator: Any) -> ThreadingHTTPServer:
    server = _mlx_server()
    handler = _handler_class()
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = next(iter(infos))

    class Server(ThreadingHTTPServer):
        address_family = family
        daemon_threads = True

    fingerprint: list[str] = []

    def handle(*a: Any, **k: Any) -> Any:
        # Taken by the first connection's handler, after listening, as mlx-lm does (per
        # connection): MLX's device_info reads the GPU's properties (on CUDA, NVML's too).
        if not fingerprint:
            fingerprint.append(server.get_system_fingerprint())
        return handler(generator, *a, system_fingerprint=fingerprint[0], **k)

    httpd = Server(address, handle)  # type: ignore[arg-type]
    httpd.kvtrio_in_flight = InFlight()  # type: ignore[attr-defined]
    return httpd


def serve(args: argparse.Namespace) -> int:
    """Run ``kvtrio serve`` until SIGTERM/SIGINT (rule 4); the exit status."""
    import mlx.core as mx

    server = _mlx_server()
    # What mlx_lm.server's main does once its flags are parsed, before any thread starts:
    # the wired limit (Metal), and the first device_info (on CUDA the driver and NVML).
    server.maybe_set_recommended_wired_limit()
    if mx.distributed.init().size() > 1:
        raise SystemExit("kvtrio serve: distributed runs are not supported")
    if str(args.model).endswith(".gguf"):  # converted once, beside the cold tier's files
        from kvtrio.serve.gguf import gguf_model_dir

        args.model = str(gguf_model_dir(args.model, Path(args.cache_dir) / "gguf"))
    options = ServeOptions.from_args(args)
    opening = ColdOpening(lambda: options.tier_options(model_identity(args)), freeze=True)
    adapter = ServeCache(
        args.prompt_cache_size,
        options.hot_bytes if options.hot_bytes is not None else 1 << 63,
        opening=opening,
        tier_model=(args.model, args.adapter_path, args.draft_model),
        load_timeout=options.cold_load_timeout,
        load_in_lookup=False,  # rule 3: set per lookup (_set_lookup_mode); never while busy
        save_trace=options.saves(),
    )
    provider = server.ModelProvider(args)
    generator = _generator_class()(provider, adapter)
    try:
        httpd = _http_server(args.host, args.port, generator)
    except BaseException:  # a port taken, a host unknown: the generation thread ends too
        generator.stop_and_join()
        raise
    httpd.kvtrio_adapter = adapter  # type: ignore[attr-defined]
    stopping = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if stopping.is_set():  # second signal: at once (rule 4)
            os.write(2, b"kvtrio serve: a second signal: exiting now, writes not finished\n")
            os._exit(1)
        stopping.set()
        threading.Thread(target=httpd.shutdown, name="kvtrio-stop", daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def when_open() -> None:  # rule 6
        opening.done.wait()
        if opening.failure is not None:
            failure = opening.failure
            print(
                f"kvtrio serve: the cold tier did not open ({type(failure).__name__}: "
                f"{failure}); stopping",
                file=sys.stderr,
                flush=True,
            )
            stopping.set()
            httpd.shutdown()
            return
        generator._wake()  # the generation thread takes the tier now
        print(f"kvtrio serve: cold tier ready (opened in {opening.seconds:.2f}s)", flush=True)

    def when_loaded() -> None:  # rule 6
        generator.model_load.done.wait()
        if (failure := generator.model_load.failure) is not None:
            print(
                f"kvtrio serve: the model did not load ({type(failure).__name__}: {failure}); "
                "stopping",
                file=sys.stderr,
                flush=True,
            )
            stopping.set()
            httpd.shutdown()

    threading.Thread(target=when_open, name="kvtrio-opened", daemon=True).start()
    threading.Thread(target=when_loaded, name="kvtrio-loaded", daemon=True).start()
    host, port = str(httpd.server_address[0]), httpd.server_address[1]
    logger.info("kvtrio serve: cold tier at %s", options.cache_dir)
    print(f"kvtrio serve: listening on {host}:{port}", flush=True)
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
    in_flight: InFlight = httpd.kvtrio_in_flight  # type: ignore[attr-defined]
    if not in_flight.wait_idle(options.grace):
        logger.info("kvtrio serve: cutting %d requests after the grace", generator.cut_all())
        in_flight.wait_idle(options.grace)
    generator.stop_and_join()
    report = print_exit(adapter, lookups_before_open=adapter.lookups_before_open)
    if opening.failure is not None or generator.model_load.failure is not None:
        return 2
    return 0 if generator.closed_in_time and report.complete else 1
