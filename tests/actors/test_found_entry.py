"""Open's entries from catalogue rows checked in bulk are the entries PrefixEntry makes."""

from __future__ import annotations

import attrs
import pytest
from kvtrio.actors.prefix import ModelKey, PrefixEntry, pack_tokens
from kvtrio.actors.tieredload import entry_of_checked

MODEL = ModelKey("tiny-llama", "fp-a")


def test_an_entry_of_checked_fields_is_the_entry_init_makes() -> None:
    """``entry_of_checked`` (open's, from catalogue rows checked in bulk) makes the entry
    ``PrefixEntry(...)`` makes: equal, of equal hash, as frozen."""
    packed = pack_tokens([5, 6, 7])
    made = PrefixEntry("k", MODEL, packed, False, 2)
    checked = entry_of_checked("k", MODEL, packed, False, 2)
    assert type(checked) is PrefixEntry
    assert checked == made and hash(checked) == hash(made)
    assert checked.tokens == (5, 6, 7) and checked.length == 3 and not checked.trimmable
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        checked.key = "other"  # type: ignore[misc]
