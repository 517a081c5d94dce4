# mypy: ignore-errors
"""The turn12 timeline probe's patches (see sitecustomize.py in this folder)."""

import functools
import importlib.abc
import importlib.machinery
import inspect
import os
import sys
import threading
import time

_now = time.perf_counter_ns
_lock = threading.Lock()
_out = None
_pid = os.getpid()
_kind = "bench"


def ev(label, edge="m", extra=""):
    thread = threading.current_thread().name.replace(" ", "_")
    line = f"{_pid} {_kind} {thread} {label} {edge} {_now()}"
    if extra:
        line += " " + extra
    with _lock:
        _out.write(line + "\n")


def _name(fn):
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__qualname__", getattr(fn, "__name__", type(fn).__name__)).replace(" ", "_")


def _span(fn, label):
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def awrapped(*a, **k):
            ev(label, "b")
            try:
                return await fn(*a, **k)
            finally:
                ev(label, "e")

        return awrapped

    @functools.wraps(fn)
    def wrapped(*a, **k):
        ev(label, "b")
        try:
            return fn(*a, **k)
        finally:
            ev(label, "e")

    return wrapped


def wrap(owner, attr, label):
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else None
    if isinstance(raw, staticmethod):
        setattr(owner, attr, staticmethod(_span(raw.__func__, label)))
    else:
        setattr(owner, attr, _span(getattr(owner, attr), label))


# -- per module -------------------------------------------------------------------------


def _mlx_server(m):
    rg = m.ResponseGenerator
    init = rg.__init__

    def __init__(self, provider, prompt_cache, *a, **k):
        # The prompt cache's own two calls, whatever its class (naive's is __main__'s).
        prompt_cache.fetch_nearest_cache = _span(prompt_cache.fetch_nearest_cache, "pc.fetch")
        prompt_cache.insert_cache = _span(prompt_cache.insert_cache, "pc.insert")
        init(self, provider, prompt_cache, *a, **k)

    rg.__init__ = __init__
    nxt = rg._next_request

    def _next_request(self, timeout=None):
        got = nxt(self, timeout)
        if got is not None and isinstance(got, tuple):
            ev("gen.took")
        return got

    rg._next_request = _next_request
    wrap(rg, "_tokenize", "tokenize")
    wrap(rg, "generate", "mlx.generate")  # handler thread: queue the request, get ctx
    m.LRUPromptCache.fetch_nearest_cache = _span(m.LRUPromptCache.fetch_nearest_cache, "lru.fetch")
    resp_init = m.Response.__init__

    def response_init(self, *a, **k):
        resp_init(self, *a, **k)
        ev("response")

    m.Response.__init__ = response_init
    gc_init = m.GenerationContext.__init__

    def ctx_init(self, *a, **k):
        gc_init(self, *a, **k)
        ev("ctx")

    m.GenerationContext.__init__ = ctx_init
    wrap(m.APIHandler, "do_POST", "handler.post")
    wrap(m.APIHandler, "_set_stream_headers", "handler.headers")


def _mlx_cache(m):
    wrap(m, "load_prompt_cache", "naive.load")
    wrap(m, "save_prompt_cache", "naive.save")
    wrap(m.LRUPromptCache, "insert_cache", "lru.insert")


def _mlx_generate(m):
    bg = m.BatchGenerator
    nxt = bg.next

    def next_(self):
        t = _now()
        out = nxt(self)
        prompt, gen = out
        if prompt or gen:
            ev("bg.next", "b", str(t))
            ev("bg.next", "e", f"{len(prompt)} {len(gen)}")
        return out

    bg.next = next_
    wrap(bg, "insert_segments", "bg.insert")


def _socketserver(m):
    write = m._SocketWriter.write

    def w(self, b):
        data = bytes(b)
        content = b'"content": "' in data and b'"content": ""' not in data
        ev("write", "m", f"{len(data)} {int(content)}")
        return write(self, b)

    m._SocketWriter.write = w


def _http_server(m):
    wrap(m.BaseHTTPRequestHandler, "parse_request", "handler.parse")


def _kv_adapter(m):
    wrap(m.TieredLRUPromptCache, "prefetch_on_arrival", "kv.arrival")
    wrap(m.TieredLRUPromptCache, "_fetch_cold", "kv.fetch_cold")
    wrap(m.TieredLRUPromptCache, "pump", "kv.pump")
    m._fetch_unadmitted = _span(m._fetch_unadmitted, "loop.fetch_unadmitted")
    m._prefetch_on_arrival = _span(m._prefetch_on_arrival, "loop.arrival")


def _kv_server(m):
    make = m._generator_class

    def _generator_class():
        cls = make()
        wrap(cls, "_tier_prompt", "kv.tier_prompt")
        wrap(cls, "generate", "kv.generate")
        return cls

    m._generator_class = _generator_class


def _kv_bridge(m):
    wrap(m.TierThread, "lookup", "kv.lookup")
    wrap(m.TierThread, "call", "kv.call")
    wrap(m.TierThread, "submit", "kv.submit")


def _kv_external(m):
    ex = m.ExternalThreadExecutor
    run = ex.run

    async def run_(self, fn, *args):
        # The job's own span on the owner thread; the queue-to-reply span on the loop.
        name = _name(fn)
        ev("owner.run." + name, "b")
        try:
            return await run(self, _span(fn, "owner.job." + name), *args)
        finally:
            ev("owner.run." + name, "e")

    ex.run = run_
    wrap(ex, "wait", "owner.wait")
    wrap(ex, "post", "owner.post")


def _kv_reader(m):
    if os.environ.get("TURN12_NOSLICE"):  # the variant: a load's reads on the normal slice
        import contextlib

        m.background_slice = lambda seconds=None: contextlib.nullcontext()
    for attr in ("_manifest_job", "_header_job", "_check_blocks_job", "_tensors_job"):
        wrap(m.Reader, attr, "worker." + attr.strip("_"))
    for attr in ("read_manifest", "read_header", "check_blocks", "read_tensors"):
        wrap(m.Reader, attr, "loop.reader." + attr)


def _kv_tier(m):
    wrap(m.ColdTier, "load", "loop.tier.load")


def _kv_tiered(m):
    wrap(m.TieredPromptCache, "fetch_nearest", "loop.fetch_nearest")


def _kv_extras(m):
    wrap(m.PolicyFeaturesMixin, "prefetch", "loop.prefetch")
    wrap(m.PolicyFeaturesMixin, "_take_prefetch", "loop.take_prefetch")
    wrap(m.PolicyFeaturesMixin, "_run_prefetch", "loop.run_prefetch")


def _kv_load(m):
    wrap(m.IndexAndLoadMixin, "_load_cold", "loop.load_cold")


def _bench_harness(m):
    chat = m.Server.chat

    def chat_(self, *a, **k):
        out = chat(self, *a, **k)
        first = out["arrivals"][0] if out["arrivals"] else out["done"]
        extra = f"{self.kind} {self.process.pid} {int(out['sent'] * 1e9)}"
        extra += f" {int(out['headers'] * 1e9)} {int(first * 1e9)} {out.get('cache')}"
        ev("client.chat", "m", extra)
        return out

    m.Server.chat = chat_


_PATCHES = {
    "mlx_lm.server": _mlx_server,
    "mlx_lm.models.cache": _mlx_cache,
    "mlx_lm.generate": _mlx_generate,
    "socketserver": _socketserver,
    "http.server": _http_server,
    "kvtrio.serve.adapter": _kv_adapter,
    "kvtrio.serve.server": _kv_server,
    "kvtrio.serve.bridge": _kv_bridge,
    "kvtrio.runtime.external": _kv_external,
    "kvtrio.actors.reader": _kv_reader,
    "kvtrio.actors.tier": _kv_tier,
    "kvtrio.actors.tiered": _kv_tiered,
    "kvtrio.actors.tieredextras": _kv_extras,
    "kvtrio.actors.tieredload": _kv_load,
    "kvtrio.bench.serve_harness": _bench_harness,
}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = _PATCHES.pop(name, None)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        inner = spec.loader.exec_module

        def exec_module(module, inner=inner, patch=patch):
            inner(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


def _server_kind():
    try:
        with open("/proc/self/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return "bench"
    if b"bench" in argv:
        return "bench"
    if b"kvtrio.bench.serve_naive" in argv:
        return "naive"
    if b"serve" in argv and b"kvtrio" in argv:
        return "kvtrio"
    if b"mlx_lm" in argv and b"server" in argv:
        return "mlx_lm"
    return "bench"


def install(path):
    global _out, _kind
    _kind = _server_kind()
    _out = open(path, "a", buffering=1)  # open for the process's life
    ev("process", "m", " ".join(sys.argv[:1]))
    sys.meta_path.insert(0, _Finder())
    for name in ("socketserver", "http.server"):  # imported before site? patch now
        if name in sys.modules:
            _PATCHES.pop(name)(sys.modules[name])
