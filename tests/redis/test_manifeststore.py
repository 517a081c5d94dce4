"""ManifestStore: the local and Redis stores keep one contract; Redis adds a shared index."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtrio.errors import CorruptCacheError, StoreUnavailableError
from kvtrio.storage.manifeststore import (
    PINS_NAME,
    LocalManifestStore,
    ManifestStore,
    RedisManifestStore,
)


@pytest.fixture(params=["local", "redis"])
def manifests(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ManifestStore]:
    store: ManifestStore
    if request.param == "local":
        store = LocalManifestStore(str(tmp_path / "manifests"))
    else:
        store = RedisManifestStore.open(request.getfixturevalue("redis_url"))
    yield store
    store.close()


def test_put_get_replace_delete_list(manifests: ManifestStore) -> None:
    assert isinstance(manifests, ManifestStore)
    assert manifests.get("a" * 64) is None
    manifests.put("a" * 64, b"first")
    manifests.put("b.kvtrio", b"other")
    manifests.put("a" * 64, b"second")
    assert manifests.get("a" * 64) == b"second"
    assert (manifests.size("a" * 64), manifests.size("absent")) == (len(b"second"), None)
    assert manifests.list() == ["a" * 64, "b.kvtrio"]
    assert manifests.delete("a" * 64) is True
    assert manifests.delete("a" * 64) is False
    assert manifests.get("a" * 64) is None
    assert manifests.list() == ["b.kvtrio"]


def test_names_cannot_escape(manifests: ManifestStore) -> None:
    for bad in ("../x", "", ".hidden", "a/b", "x" * 201, "a*"):
        with pytest.raises(CorruptCacheError, match=r"^manifest name: "):
            manifests.put(bad, b"x")
        with pytest.raises(CorruptCacheError, match=r"^manifest name: "):
            manifests.get(bad)


def test_local_store_is_not_shared(tmp_path: Path) -> None:
    store = LocalManifestStore(str(tmp_path))
    store.put("m1", b"x", index_keys=["k1"])
    assert (store.shared, store.lookup(["k1"])) == (False, [])
    assert (tmp_path / "m1").read_bytes() == b"x"
    assert not [p for p in tmp_path.iterdir() if p.name != "m1"]  # no tmp debris


def test_redis_index_finds_what_another_host_saved(redis_url: str) -> None:
    """A second client (host B) finds A's manifests by prefix key, in one round trip."""
    host_a = RedisManifestStore.open(redis_url)
    host_b = RedisManifestStore.open(redis_url)
    host_a.put("short", b"s", index_keys=["k1"])
    host_a.put("long", b"l", index_keys=["k1", "k2", "k3"])
    assert host_b.shared
    assert host_b.lookup(["k1", "k2"]) == ["long", "short"]
    assert host_b.lookup(["k3"]) == ["long"]
    assert host_b.lookup(["nothing"]) == []
    host_a.put("long", b"l2", index_keys=["k1", "k2"])  # a replacement re-registers
    assert host_b.lookup(["k3"]) == []
    host_b.delete("long")
    assert host_a.lookup(["k1", "k2"]) == ["short"]
    host_a.close()
    host_b.close()


def test_redis_manifest_tampered_is_corrupt(redis_url: str) -> None:
    """Manifests carry their own hash: bytes changed behind kvtrio's back never load."""
    store = RedisManifestStore.open(redis_url)
    store.put("m", b"manifest bytes")
    raw = store.client.get(store.manifest_key("m"))
    assert isinstance(raw, bytes)
    store.client.set(store.manifest_key("m"), raw[:-1] + b"X")
    with pytest.raises(CorruptCacheError, match=r"^manifest m: content does not match its sha256$"):
        store.get("m")
    store.client.set(store.manifest_key("m"), b"tiny")
    with pytest.raises(CorruptCacheError):
        store.get("m")
    store.close()


def test_redis_manifest_evicted_is_a_miss(redis_url: str) -> None:
    store = RedisManifestStore.open(redis_url)
    store.put("m", b"x", index_keys=["k"])
    store.client.delete(store.manifest_key("m"))
    assert store.get("m") is None
    assert store.lookup(["k"]) == ["m"]  # the reader skips names whose manifest is gone
    assert store.lookup_each(["k", "other"]) == [["m"], []]
    store.close()


def test_redis_lookup_each_limit(redis_url: str) -> None:
    """With a limit, a key naming many manifests (a shared system prompt) returns a few."""
    store = RedisManifestStore.open(redis_url)
    for i in range(20):
        store.put(f"m{i}", b"x", index_keys=["shared", f"own{i}"])
    few, own, none = store.lookup_each(["shared", "own3", "nothing"], limit=3)
    assert len(set(few)) == 3 and set(few) <= {f"m{i}" for i in range(20)}
    assert (own, none) == (["m3"], [])
    assert len(store.lookup_each(["shared"])[0]) == 20
    with pytest.raises(ValueError, match=r"^limit must be at least 1, got 0$"):
        store.lookup_each(["shared"], limit=0)
    store.close()


def test_redis_unregister_drops_only_stale_entries(redis_url: str) -> None:
    """A stale registration (its manifest gone) is removed from the index keys named; a
    live one is kept."""
    store = RedisManifestStore.open(redis_url)
    store.put("live", b"x", index_keys=["k1", "k2"])
    store.put("gone", b"y", index_keys=["k1", "k2"])
    assert store.unregister("live", ["k1", "k2"]) is False
    store.client.delete(store.manifest_key("gone"))
    assert store.unregister("gone", ["k1", "k2", "k3"]) is True
    assert store.lookup_each(["k1", "k2"]) == [["live"], ["live"]]
    store.close()


def test_redis_down_is_store_unavailable(private_redis: object) -> None:
    store = RedisManifestStore.open(private_redis.url())  # type: ignore[attr-defined]
    private_redis.kill()  # type: ignore[attr-defined]
    with pytest.raises(StoreUnavailableError, match=r"^redis redis://127\.0\.0\.1:\d+/0"):
        store.put("m", b"x", index_keys=["k"])
    with pytest.raises(StoreUnavailableError):
        store.lookup(["k"])
    store.close()


def test_last_uses_are_recorded_and_ordered(manifests: ManifestStore) -> None:
    """Both stores keep a last use per manifest (the tier's LRU order across restarts):
    set at put, moved by touch, gone with the manifest; touching an absent name adds
    nothing."""
    manifests.put("a", b"1")
    manifests.put("b", b"2")
    manifests.touch({"a": 2_000_000_000.0, "ghost": 5.0})
    used_a, used_b, ghost = manifests.last_uses(["a", "b", "ghost"])
    assert ghost is None and used_a is not None and used_b is not None
    assert used_a == pytest.approx(2_000_000_000.0) and used_b < used_a
    manifests.delete("a")
    assert manifests.last_uses(["a"]) == [None]
    assert manifests.get("ghost") is None


def test_pins_are_recorded_and_go_with_the_manifest(manifests: ManifestStore) -> None:
    """Both stores keep the pinned names (a tier's pins across restarts, its catalogue
    lost or not): set and cleared by set_pinned, gone when the manifest is deleted."""
    manifests.put("a", b"1")
    manifests.put("b", b"2")
    assert manifests.supports_pins and manifests.pinned_names() == set()
    manifests.set_pinned({"a": True, "b": True})
    manifests.set_pinned({"b": False})
    assert manifests.pinned_names() == {"a"}
    manifests.delete("a")
    assert manifests.pinned_names() == set()


def test_local_pins_survive_a_new_store_and_hostile_records_are_corrupt(tmp_path: Path) -> None:
    directory = tmp_path / "manifests"
    first = LocalManifestStore(str(directory))
    first.put("a.kvc", b"1")
    first.set_pinned({"a.kvc": True})
    assert LocalManifestStore(str(directory)).pinned_names() == {"a.kvc"}
    assert first.list() == ["a.kvc"]  # the record is no manifest
    pins = directory / PINS_NAME
    for hostile in (b"{not json", b'["../escape"]', b'{"a.kvc": 1}'):
        pins.write_bytes(hostile)
        with pytest.raises(CorruptCacheError):
            LocalManifestStore(str(directory)).pinned_names()
    pins.unlink()
    pins.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CorruptCacheError, match="symbolic link"):
        LocalManifestStore(str(directory)).pinned_names()
    pins.unlink()
    pins.write_bytes(b"{not json")
    damaged = LocalManifestStore(str(directory))
    assert damaged.delete("a.kvc")  # an unreadable record fails no deletion
    damaged.put("b.kvc", b"2")
    damaged.set_pinned({"b.kvc": True})  # and the next change replaces it
    assert LocalManifestStore(str(directory)).pinned_names() == {"b.kvc"}
