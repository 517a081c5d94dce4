"""A trio HTTP server (h11) that embeds kvtrio's tiered prompt cache.

Run it::

    python examples/tiered_server.py --port 8000 --data-dir /tmp/kvtrio-example

and ask it to continue token sequences (without ``--model`` the model is kvtrio's tiny
random-weight llama, so the tokens mean nothing; the caching is real)::

    curl -s localhost:8000/generate -d '{"conversation": "c1", "tokens": [5, 6, 7]}'
    curl -s localhost:8000/stats

With ``--model DIR`` (an mlx-lm model directory, or a Hugging Face repo id, loaded with
``mlx_lm.load``) it also takes text: ``/chat`` renders the messages with the model's chat
template, ``/generate`` accepts ``"prompt"`` text in place of ``"tokens"``, and replies
carry the decoded ``"text"`` (greedy decoding, stopped at the model's end-of-sequence)::

    python examples/tiered_server.py --model mlx-community/SmolLM2-135M-Instruct-8bit \\
        --data-dir /tmp/kvtrio-example
    curl -s localhost:8000/chat -d '{"conversation": "c1", "max_tokens": 32,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}'

Each reply says where its prompt cache came from: ``hot`` (RAM), ``cold`` (disk) or
``miss``. Stop it with SIGTERM or Ctrl-C: it stops accepting, lets requests in flight
finish (``--grace`` seconds at most), writes the cache's RAM entries to disk and exits 0,
so the next start serves the same conversations from disk: those of at least 64 tokens
(the tier's ``min_reuse_tokens``; fewer are recomputed, faster than a load, so the short
question above is a ``miss`` again after a restart). A second signal cancels at once.

Every loop is bounded: requests per connection, bytes per request, events per read,
tokens per prompt and per reply.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import h11
import trio
from kvtrio.actors.owner import MlxOwner
from kvtrio.actors.prefix import ModelKey
from kvtrio.actors.tiered import TieredPromptCache, open_tiered_cache
from kvtrio.storage.fingerprint import config_fingerprint
from kvtrio.tinymodel import TinyModel, build_tiny_model, make_caches, prefill

MAX_REQUESTS_PER_CONNECTION = 100
MAX_BODY_BYTES = 1 << 20
MAX_EVENTS_PER_REQUEST = 10_000
MAX_PROMPT_TOKENS = 8192
MAX_REPLY_TOKENS = 64
READ_TIMEOUT_S = 30.0


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def load_model_dir(model: str) -> tuple[TinyModel, Any]:
    """Owner thread: ``mlx_lm.load`` the model directory (or repo id) ``model``; return it
    with its identity (the tier's key: a fingerprint of its config and weight files) and
    its tokenizer."""
    from mlx_lm import load
    from mlx_lm.utils import _download

    path = Path(model) if Path(model).exists() else Path(_download(model))
    loaded: Any = load(str(path))
    mlx_model, tokenizer = loaded[0], loaded[1]
    config = json.loads((path / "config.json").read_text())
    weights = hashlib.sha256()
    for item in sorted(path.glob("*.safetensors")):
        weights.update(f"{item.name}:{item.stat().st_size};".encode())
    fingerprint = config_fingerprint(config, weights_id=weights.hexdigest())
    vocab = int(config.get("vocab_size") or len(tokenizer.get_vocab()))
    return TinyModel(mlx_model, str(model), fingerprint, vocab), tokenizer


def _generate(
    tiny: TinyModel, caches: list[Any], rest: list[int], steps: int, stop: frozenset[int]
) -> list[int]:
    """Owner thread: prefill ``rest`` into ``caches``, then greedy-decode up to ``steps``
    tokens, ending after a token of ``stop``."""
    import mlx.core as mx

    logits = prefill(tiny, caches, rest)
    out: list[int] = []
    for _ in range(steps):
        token = mx.argmax(logits).item()
        assert isinstance(token, int)
        out.append(token)
        logits = prefill(tiny, caches, [token])
        if token in stop:
            break
    return out


@attrs.frozen
class GenerateRequest:
    conversation: str | None
    tokens: list[int]
    max_tokens: int


@attrs.define(eq=False)
class App:
    owner: MlxOwner
    tiny: TinyModel
    cache: TieredPromptCache
    tokenizer: Any = None  # with --model: the model's (mlx-lm's TokenizerWrapper)
    draining: bool = False
    idle: set[trio.CancelScope] = attrs.field(factory=set)
    lock: trio.Lock = attrs.field(factory=trio.Lock)

    async def dispatch(self, method: str, target: str, body: bytes) -> tuple[int, Any]:
        if method == "GET" and target == "/healthz":
            return 200, {"ok": True}
        if method == "GET" and target == "/stats":
            return 200, attrs.asdict(self.cache.statistics())
        if method == "POST" and target == "/generate":
            return 200, await self.generate(self._parse(body, chat=False))
        if method == "POST" and target == "/chat":
            if self.tokenizer is None:
                raise HttpError(404, "/chat needs a model with a tokenizer: start with --model")
            return 200, await self.generate(self._parse(body, chat=True))
        raise HttpError(404, f"no route for {method} {target}")

    def _parse(self, body: bytes, *, chat: bool) -> GenerateRequest:
        raw = _json_object(body)
        tokens: Any
        if chat:
            tokens = _chat_tokens(self.tokenizer, raw.get("messages"))
        elif "prompt" in raw and self.tokenizer is not None:
            prompt = raw["prompt"]
            if not isinstance(prompt, str) or not prompt:
                raise HttpError(400, "prompt: a non-empty string")
            tokens = list(self.tokenizer.encode(prompt))
        else:
            tokens = raw.get("tokens")
        return _parse_generate(raw, tokens, self.tiny.vocab_size)

    async def generate(self, request: GenerateRequest) -> dict[str, Any]:
        conversation, tokens, max_tokens = request.conversation, request.tokens, request.max_tokens
        stop: frozenset[int] = frozenset()
        if self.tokenizer is not None:
            stop = frozenset(self.tokenizer.eos_token_ids)
        async with self.lock:  # one model step at a time, like mlx-lm's server
            start = time.perf_counter()
            fetched = await self.cache.fetch_nearest(tokens, need_logits=True)
            caches = fetched.caches
            if caches is None:
                caches = await self.owner.run(make_caches, self.tiny)
            rest = list(fetched.remaining)
            reply = await self.owner.run(_generate, self.tiny, caches, rest, max_tokens, stop)
            elapsed = time.perf_counter() - start
            await self.cache.insert(tokens + reply, caches, conversation=conversation)
        out = {
            "reply": reply,
            "cache": fetched.tier.value if fetched.tier is not None else "miss",
            "reused": fetched.reused,
            "prompt_tokens": len(tokens),
            "seconds": round(elapsed, 6),
        }
        if self.tokenizer is not None:
            out["text"] = self.tokenizer.decode([t for t in reply if t not in stop])
        return out


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        raw = json.loads(body)
    except ValueError:
        raise HttpError(400, "body is not JSON") from None
    if not isinstance(raw, dict):
        raise HttpError(400, "body must be a JSON object")
    return raw


def _chat_tokens(tokenizer: Any, messages: Any) -> list[int]:
    """The prompt of ``messages`` as the model's chat template renders it."""
    if (
        not isinstance(messages, list)
        or not messages
        or not all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise HttpError(400, "messages: a non-empty list of {role, content} strings")
    rendered = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in messages],
        add_generation_prompt=True,
    )
    return list(rendered)


def _parse_generate(raw: dict[str, Any], tokens: Any, vocab: int) -> GenerateRequest:
    if (
        not isinstance(tokens, list)
        or not 1 <= len(tokens) <= MAX_PROMPT_TOKENS
        or not all(isinstance(t, int) and 0 <= t < vocab for t in tokens)
    ):
        raise HttpError(400, f"tokens: 1..{MAX_PROMPT_TOKENS} ints in [0, {vocab})")
    max_tokens = raw.get("max_tokens", 8)
    if not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_REPLY_TOKENS:
        raise HttpError(400, f"max_tokens: an int in [1, {MAX_REPLY_TOKENS}]")
    conversation = raw.get("conversation")
    if conversation is not None and not isinstance(conversation, str):
        raise HttpError(400, "conversation: a string")
    return GenerateRequest(conversation, tokens, max_tokens)


# -- HTTP/1.1 over h11 ---------------------------------------------------------------------


async def _next_event(stream: trio.SocketStream, conn: h11.Connection) -> Any:
    for _ in range(MAX_EVENTS_PER_REQUEST):
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        with trio.fail_after(READ_TIMEOUT_S):
            data = await stream.receive_some(65536)
        conn.receive_data(data)
    raise HttpError(400, "request too fragmented")


async def _read_request(
    stream: trio.SocketStream, conn: h11.Connection, app: App
) -> tuple[h11.Request, bytes] | None:
    """The next request and its body; None when the client closed or we are draining."""
    scope = trio.CancelScope()
    app.idle.add(scope)
    try:
        with scope:
            if app.draining:
                return None
            event = await _next_event(stream, conn)
    finally:
        app.idle.discard(scope)
    if scope.cancelled_caught or isinstance(event, h11.ConnectionClosed):
        return None
    if not isinstance(event, h11.Request):
        raise HttpError(400, "expected a request")
    body = bytearray()
    for _ in range(MAX_EVENTS_PER_REQUEST):
        part = await _next_event(stream, conn)
        if isinstance(part, h11.EndOfMessage):
            return event, bytes(body)
        if isinstance(part, h11.Data):
            body += part.data
            if len(body) > MAX_BODY_BYTES:
                raise HttpError(413, "body too large")
    raise HttpError(400, "request too fragmented")


async def _send(stream: trio.SocketStream, conn: h11.Connection, status: int, body: Any) -> None:
    payload = json.dumps(body).encode()
    headers = [("content-type", "application/json"), ("content-length", str(len(payload)))]
    await stream.send_all(conn.send(h11.Response(status_code=status, headers=headers)))
    await stream.send_all(conn.send(h11.Data(data=payload)))
    await stream.send_all(conn.send(h11.EndOfMessage()))


async def handle_connection(app: App, stream: trio.SocketStream) -> None:
    conn = h11.Connection(h11.SERVER)
    try:
        for _ in range(MAX_REQUESTS_PER_CONNECTION):
            try:
                got = await _read_request(stream, conn, app)
                if got is None:
                    break
                request, body = got
                status, reply = await app.dispatch(
                    request.method.decode(), request.target.decode(), body
                )
            except HttpError as exc:
                if conn.our_state is not h11.SEND_RESPONSE:
                    break
                status, reply = exc.status, {"error": str(exc)}
            except (h11.RemoteProtocolError, trio.TooSlowError):
                break
            except Exception as exc:  # the HTTP boundary: one request fails, not the server
                if conn.our_state is not h11.SEND_RESPONSE:
                    break
                status, reply = 500, {"error": f"{type(exc).__name__}: {exc}"}
            await _send(stream, conn, status, reply)
            if app.draining or conn.our_state is h11.MUST_CLOSE:
                break
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                break
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await stream.aclose()


# -- running it ----------------------------------------------------------------------------


async def serve(args: argparse.Namespace) -> None:
    async with MlxOwner.dedicated() as owner:
        tokenizer = None
        if args.model is None:
            tiny = await owner.run(build_tiny_model)
        else:
            tiny, tokenizer = await owner.run(load_model_dir, args.model)
        async with open_tiered_cache(
            args.data_dir,
            ModelKey(tiny.model_id, tiny.fingerprint),
            owner=owner,
            hot_budget=int(args.hot_mb * (1 << 20)),
            cold_budget=int(args.cold_mb * (1 << 20)),
            block_size=64,
        ) as cache:
            app = App(owner, tiny, cache, tokenizer)
            await _serve_until_signalled(app, args)
        print("cache written; bye", flush=True)


async def _serve_until_signalled(app: App, args: argparse.Namespace) -> None:
    """Serve until SIGTERM/SIGINT, then drain: stop accepting, close idle connections,
    let requests in flight finish within ``args.grace`` seconds. A second signal cancels
    whatever is left."""
    stop = trio.Event()
    doomed: list[trio.CancelScope] = []

    async def watch_signals(task_status: trio.TaskStatus[None]) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for signum in signals:
                if not stop.is_set():
                    print(f"{signal.Signals(signum).name}: draining", flush=True)
                    stop.set()
                else:
                    for scope in doomed:
                        scope.cancel()

    async with trio.open_nursery() as outer:
        await outer.start(watch_signals)
        listeners = await trio.open_tcp_listeners(args.port, host=args.host)
        port = listeners[0].socket.getsockname()[1]
        handler: Callable[[trio.SocketStream], Awaitable[None]] = partial(handle_connection, app)
        async with trio.open_nursery() as connections:
            doomed.append(connections.cancel_scope)
            async with trio.open_nursery() as accept:
                accept.start_soon(
                    partial(trio.serve_listeners, handler_nursery=connections), handler, listeners
                )
                print(f"listening on http://{args.host}:{port}", flush=True)
                await stop.wait()
                accept.cancel_scope.cancel()
            for listener in listeners:
                await listener.aclose()
            app.draining = True
            for scope in list(app.idle):
                scope.cancel()
            connections.cancel_scope.deadline = trio.current_time() + args.grace
        outer.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument(
        "--model",
        help="an mlx-lm model directory or repo id (default: kvtrio's tiny random llama)",
    )
    parser.add_argument("--hot-mb", type=float, default=64.0)
    parser.add_argument("--cold-mb", type=float, default=1024.0)
    parser.add_argument("--grace", type=float, default=10.0, help="seconds to finish requests")
    args = parser.parse_args(argv)
    if args.model is not None and (problem := _not_a_model(args.model)):
        parser.error(f"--model {args.model}: {problem}")  # exit 2, before MLX starts
    trio.run(serve, args)
    return 0


def _not_a_model(model: str) -> str | None:
    """Why a local ``--model`` is no mlx-lm model directory (None: it is one, or names a
    Hugging Face repo); before, mlx_lm.load's traceback said it."""
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        return "a GGUF file: this example loads mlx-lm directories (kvtrio serve converts GGUF)"
    if path.exists():
        return None if (path / "config.json").is_file() else "no config.json in it"
    looks_local = model.startswith(("/", ".", "~")) or model.count("/") != 1
    return "no such directory" if looks_local else None


if __name__ == "__main__":
    sys.exit(main())
