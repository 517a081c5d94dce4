"""The synchronous API for scripts: ``kvtrio.save_cache`` and ``kvtrio.load_cache``.

These run every step on the calling thread (which must be the thread that owns the MLX
arrays: for a script, the main thread). Servers use the actors instead, which split the
same steps between the MLX owner thread and worker threads.

    import kvtrio
    kvtrio.save_cache("chat.kvt", tokens, caches,
                      meta={"model_id": "tiny-llama", "config_fingerprint": fp})
    loaded = kvtrio.load_cache("chat.kvt",
                               expect=kvtrio.Expect.for_model(model, model_id="tiny-llama",
                                                              config_fingerprint=fp))
    loaded.caches, loaded.tokens, loaded.attachments

``layout="blocks"`` writes ``path`` as a manifest and the tensor bytes as sha256 blocks
under ``<dirname(path)>/blocks/`` (or the ``store`` given): caches sharing a prefix share
those blocks on disk.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import attrs
import kvtrio.metal.codec  # noqa: F401  (registers the paged codec: every built-in kind loads)
from kvtrio.errors import (
    CacheMismatchError,
    CacheMissError,
    CorruptCacheError,
    InvalidInputError,
    KvtrioError,
)
from kvtrio.storage.blockstore import BlockStore, LocalBlockStore
from kvtrio.storage.cacheio import AttachmentData, Restored, adopt, materialize, snapshot
from kvtrio.storage.codecs import check_kinds
from kvtrio.storage.fileops import OS_FILE_OPS
from kvtrio.storage.format import Header, Layout
from kvtrio.storage.hostbuffers import LoadBuffers, allocate_slot, check_allocatable
from kvtrio.storage.options import DEFAULT_IO_OPTIONS, SCRIPT_LOAD_STREAMS, IoOptions
from kvtrio.storage.reader import CacheFile, check_blocks, read_header, read_tensors
from kvtrio.storage.structure import cache_structure, header_structure
from kvtrio.storage.writable import check_meta, check_str_arg, check_token_ids
from kvtrio.storage.writer import (
    DEFAULT_BLOCK_TOKENS,
    WriteResult,
    tmp_path_for,
    write_blocks,
    write_single,
)

__all__ = [
    "Expect",
    "LoadedCache",
    "default_block_store",
    "export_mlx_lm",
    "import_mlx_lm",
    "load_cache",
    "save_cache",
]

LoadedCache = Restored

_HEADER_META_KEYS = frozenset({"model_id", "config_fingerprint", "attachments"})


@attrs.frozen
class Expect:
    """What a loaded cache must match; ``None`` fields are not checked.

    ``structure`` is :func:`kvtrio.storage.structure.cache_structure` of the caches the
    model makes (kinds, per-kind structural fields such as window size or quantization,
    nesting); :meth:`for_model` computes it from an mlx-lm model.
    """

    model_id: str | None = None
    config_fingerprint: str | None = None
    structure: tuple[Any, ...] | None = None

    @classmethod
    def for_model(
        cls,
        model: Any,
        *,
        model_id: str | None = None,
        config_fingerprint: str | None = None,
        max_kv_size: int | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
    ) -> Expect:
        """Expect the cache structure ``make_prompt_cache(model)`` produces.

        ``kv_bits`` / ``kv_group_size``: the server quantizes its KV caches (mlx-lm's
        ``kv_bits`` option), so plain KV layers are expected as quantized ones.
        """
        from mlx_lm.models import cache as mlx_cache_module

        mlx_cache: Any = mlx_cache_module
        template = mlx_cache.make_prompt_cache(model, max_kv_size=max_kv_size)
        if kv_bits is not None:
            template = [
                mlx_cache.QuantizedKVCache(group_size=kv_group_size, bits=kv_bits)
                if type(c) is mlx_cache.KVCache
                else c
                for c in template
            ]
        structure = cache_structure(template)
        return cls(model_id=model_id, config_fingerprint=config_fingerprint, structure=structure)

    def check(self, header: Header) -> None:
        """Raise CacheMismatchError naming the first thing that differs."""
        if self.model_id is not None and header.model_id != self.model_id:
            raise CacheMismatchError(
                f"model_id: cache is for {header.model_id!r}, expected {self.model_id!r}"
            )
        if self.config_fingerprint is not None and (
            header.config_fingerprint != self.config_fingerprint
        ):
            raise CacheMismatchError(
                f"config_fingerprint: cache has {header.config_fingerprint!r}, "
                f"expected {self.config_fingerprint!r}"
            )
        if self.structure is not None:
            got = header_structure(header)
            if len(got) != len(self.structure):
                raise CacheMismatchError(
                    f"structure: cache has {len(got)} layers, the model has {len(self.structure)}"
                )
            for i, (have, want) in enumerate(zip(got, self.structure, strict=True)):
                if have != want:
                    raise CacheMismatchError(
                        f"structure: layer {i} is {have!r:.120}, the model has {want!r:.120}"
                    )


def default_block_store(path: str | os.PathLike[str]) -> LocalBlockStore:
    """The block store a manifest at ``path`` uses by default: ``<dir>/blocks``."""
    return LocalBlockStore(os.path.join(os.path.dirname(os.path.abspath(path)), "blocks"))


def save_cache(
    path: str | os.PathLike[str],
    tokens: Sequence[int],
    caches: Sequence[Any],
    *,
    meta: Mapping[str, Any] | None = None,
    layout: Layout = "single",
    store: BlockStore | None = None,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    options: IoOptions = DEFAULT_IO_OPTIONS,
) -> WriteResult:
    """Durably save ``caches`` (mlx-lm cache objects) holding ``tokens`` to ``path``.

    ``meta`` keys ``model_id`` and ``config_fingerprint`` (str) go into the header fields
    of those names, ``attachments`` (a sequence of
    :class:`~kvtrio.storage.cacheio.AttachmentData`) are saved beside the caches, and every
    other key must map to a string and is kept in the header's ``meta``. ``options``
    tune the I/O (:class:`~kvtrio.storage.options.IoOptions`; docs/tuning.md), never the
    bytes written. Returns after fsync(file), rename and fsync(dir).

    Nothing is written unless the file would load: ``tokens`` must be ints in
    ``[0, 2**31)``, one per token every cache holds (each layer's offset), else
    CacheMismatchError; a bad ``meta`` value or any header field the reader would refuse
    is InvalidInputError naming it.
    """
    if layout not in ("single", "blocks"):
        raise InvalidInputError(f"layout must be 'single' or 'blocks', not {layout!r}")
    meta = dict(meta or {})
    attachments: Sequence[AttachmentData] = meta.get("attachments") or ()
    extra = check_meta({k: v for k, v in meta.items() if k not in _HEADER_META_KEYS})
    ids = {
        key: None if meta.get(key) is None else check_str_arg(meta[key], f"meta[{key!r}]")
        for key in ("model_id", "config_fingerprint")
    }
    snap = snapshot(
        caches,
        check_token_ids(tokens),
        model_id=ids["model_id"],
        config_fingerprint=ids["config_fingerprint"],
        meta=extra,
        attachments=attachments,
    )
    target = os.fspath(path)
    if layout == "single":
        host = materialize(snap, options=options)
        segments = [h.segments[0] for h in host]
        return write_single(target, snap.header, segments, options=options)
    if layout == "blocks":
        host = materialize(snap, block_tokens=block_tokens, options=options)
        return write_blocks(
            target,
            snap.header,
            [h.segments for h in host],
            store if store is not None else default_block_store(target),
            block_tokens=block_tokens,
        )
    raise AssertionError("unreachable: layout was checked")


def load_cache(
    path: str | os.PathLike[str],
    *,
    expect: Expect | None = None,
    verify: bool = True,
    store: BlockStore | None = None,
    options: IoOptions = DEFAULT_IO_OPTIONS,
) -> LoadedCache:
    """Load a cache file or manifest saved by :func:`save_cache`, bit-exact.

    The header is validated before anything in it is used; with ``verify`` (the default)
    every tensor's xxh3 or every block is checked before any array is built (a block of a
    local store against its manifest's xxh3, else against its sha256 name; docs/format.md
    rule 10).
    Raises CorruptCacheError (a bad file), CacheMismatchError (``expect`` not met),
    UnknownCacheKindError (a cache kind with no registered codec) or CacheMissError (no
    file at ``path``, or a block is missing). ``options`` tune the I/O (``load_streams``
    threads read the tensors, one tensor per task; docs/tuning.md), never what is checked.
    """
    if expect is not None and not isinstance(expect, Expect):
        raise InvalidInputError(f"expect: expected an Expect, got {type(expect).__name__}")
    target = os.fspath(path)
    try:
        cache_file = read_header(target)
    except FileNotFoundError as exc:
        raise CacheMissError(f"no cache file at {target!r}") from exc
    if expect is not None:
        expect.check(cache_file.header)
    check_kinds(cache_file.header)
    if cache_file.header.layout == "blocks" and store is None:
        store = default_block_store(target)
    if store is not None and cache_file.header.layout == "blocks":
        check_blocks(cache_file.header, store)  # before allocating what the manifest claims
    check_allocatable(cache_file.header.nbytes)
    return adopt(cache_file.header, _read_pipelined(cache_file, store, verify, options))


def _read_pipelined(
    cache_file: CacheFile, store: BlockStore | None, verify: bool, options: IoOptions
) -> LoadBuffers:
    """Read straight into MLX-owned memory, allocating slot i+1 while slot i is read.

    Allocation (page faults) runs on this thread, the MLX owner; reads and hash checks run
    on worker threads, which touch only the byte views. No host-side copy of tensor bytes.
    ``options.load_streams`` threads read, one tensor per task (by default
    :data:`~kvtrio.storage.options.SCRIPT_LOAD_STREAMS`, 4). The pool is always joined
    (no thread is abandoned); the first failing slot, in slot order, raises.
    """
    header = cache_file.header
    stop = threading.Event()
    arrays: list[tuple[Any, ...]] = []
    views: list[tuple[memoryview, ...]] = []
    futures: list[Future[None]] = []
    threads = options.streams(SCRIPT_LOAD_STREAMS)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvtrio-read") as pool:
        try:
            for index in range(sum(1 for _ in header.slots())):
                slot_arrays, slot_views = allocate_slot(header, index, options=options)
                arrays.append(slot_arrays)
                views.append(slot_views)
                futures.append(
                    pool.submit(
                        read_tensors,
                        cache_file,
                        [slot_views],
                        indices=[index],
                        store=store,
                        verify=verify,
                        cancel=stop.is_set,
                        options=options,
                    )
                )
            for future in futures:
                future.result()
        except BaseException:
            stop.set()
            raise
    return LoadBuffers(arrays=tuple(arrays), buffers=tuple(views))


def import_mlx_lm(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    tokens: Sequence[int] = (),
    meta: Mapping[str, Any] | None = None,
    layout: Layout = "single",
) -> WriteResult:
    """Convert an mlx-lm prompt-cache file (``save_prompt_cache``) into a kvtrio cache.

    mlx-lm files carry no token list: pass ``tokens`` to make the result findable by
    prefix. mlx-lm's string metadata is kept in the header's ``meta`` (``meta`` overrides).

    The source is untrusted: whatever mlx-lm's loader or the caches it builds raise is
    CorruptCacheError (CacheMissError: no such file; the caller's own arguments are
    checked as :func:`save_cache` does). The result is written under a tmp name, loaded
    back with :func:`load_cache` (every hash checked) and only then renamed to ``dst``:
    a file ``load_cache`` would refuse is never published.
    """
    from mlx_lm.models import cache as mlx_cache

    source = os.fspath(src)
    if not os.path.isfile(source):
        raise CacheMissError(f"no mlx-lm prompt cache file at {source!r}")
    try:
        caches, metadata = cast(Any, mlx_cache).load_prompt_cache(source, return_metadata=True)
        merged: dict[str, Any] = {str(k): str(v) for k, v in dict(metadata or {}).items()}
    except Exception as exc:  # a hostile file: RecursionError, KeyError, MLX's errors...
        raise _not_an_mlx_lm_cache(source, exc) from exc
    merged.update(meta or {})
    target = os.path.abspath(os.fspath(dst))
    staging = tmp_path_for(target)
    try:
        try:
            result = save_cache(staging, tokens, caches, meta=merged, layout=layout)
            load_cache(staging)
        except KvtrioError:
            raise
        except Exception as exc:  # the caches mlx-lm built from it are not consistent
            raise _not_an_mlx_lm_cache(source, exc) from exc
        os.replace(staging, target)
    except BaseException:
        try:
            os.unlink(staging)
        except OSError:
            pass
        raise
    OS_FILE_OPS.fsync_dir(os.path.dirname(target))
    return attrs.evolve(result, path=target)


def _not_an_mlx_lm_cache(source: str, exc: BaseException) -> CorruptCacheError:
    detail = str(exc).splitlines()[0][:160] if str(exc) else ""
    return CorruptCacheError(
        f"{source}: not a valid mlx-lm prompt cache ({type(exc).__name__}: {detail})"
    )


def export_mlx_lm(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    verify: bool = True,
) -> LoadedCache:
    """Write a kvtrio cache as an mlx-lm ``.safetensors`` prompt-cache file.

    The header's ``meta`` becomes mlx-lm metadata, plus ``model_id``,
    ``config_fingerprint`` and ``tokens`` (JSON) when present. Attachments have no place
    in mlx-lm's format and are not exported. Returns the loaded cache.
    """
    import json

    from mlx_lm.models.cache import save_prompt_cache

    loaded = load_cache(src, verify=verify)
    header = loaded.header
    metadata = dict(header.meta)
    if header.model_id is not None:
        metadata["model_id"] = header.model_id
    if header.config_fingerprint is not None:
        metadata["config_fingerprint"] = header.config_fingerprint
    metadata["tokens"] = json.dumps(list(header.tokens))
    save_prompt_cache(os.fspath(dst), loaded.caches, metadata=metadata)
    return loaded
