"""The demo's state between runs: its conversations (a JSON file) and logit probes (.npy).

``kvtrio demo`` continues the same conversations on every run, so a run after a restart
meets prompts whose prefixes an earlier process saved; the probes are the logits each
entry gave when it was stored, to check a later cold hit against.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from kvtrio.cli.demo import DemoOptions

__all__ = [
    "STATE_VERSION",
    "Conversation",
    "arrays_equal",
    "load_probe",
    "load_state",
    "next_prompt",
    "plan_conversations",
    "random_tokens",
    "save_probe",
    "save_state",
]


STATE_VERSION = 1
@attrs.define
class Conversation:
    cid: str
    kind: str  # "chat" or "doc"
    tokens: list[int]
    turns: int = 0

    def limit(self, options: DemoOptions) -> int:
        extra = 6 * (options.question_tokens + options.reply_tokens)  # three more runs
        return options.doc_tokens + extra if self.kind == "doc" else options.max_chat_tokens


def arrays_equal(a: Any, b: Any) -> bool:
    import mlx.core as mx

    return bool(mx.array_equal(a, b))


def save_probe(path: Path, probe: Any) -> None:
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, probe)
    os.replace(tmp, path)


def load_probe(path: Path) -> Any:
    import numpy as np

    try:
        return np.load(path)
    except (OSError, ValueError):
        return None


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 512) for _ in range(n)]


def load_state(path: Path, fingerprint: str) -> tuple[int, list[Conversation]]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return 0, []
    if raw.get("version") != STATE_VERSION or raw.get("fingerprint") != fingerprint:
        return 0, []
    convs = [
        Conversation(c["cid"], c["kind"], [int(t) for t in c["tokens"]], int(c["turns"]))
        for c in raw.get("conversations", [])
    ]
    return int(raw.get("run", 0)), convs


def save_state(path: Path, fingerprint: str, run: int, convs: list[Conversation]) -> None:
    body = {
        "version": STATE_VERSION,
        "fingerprint": fingerprint,
        "run": run,
        "conversations": [attrs.asdict(c) for c in convs],
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)


def next_prompt(conv: Conversation, system: list[int], opts: DemoOptions, seed: int) -> list[int]:
    rng = random.Random(f"{opts.seed}/{conv.cid}/{conv.turns}/{seed}")
    if not conv.tokens:
        if conv.kind == "doc":
            body = opts.doc_tokens - len(system) - opts.question_tokens
            return system + random_tokens(rng, body) + random_tokens(rng, opts.question_tokens)
        return system + random_tokens(rng, opts.user_tokens)
    n = opts.question_tokens if conv.kind == "doc" else opts.user_tokens
    return conv.tokens + random_tokens(rng, n)


def plan_conversations(
    previous: list[Conversation], opts: DemoOptions, run: int
) -> list[Conversation]:
    """Returning conversations that still fit, topped up with new ones."""
    rounds = 2  # one turn before the restart, one after
    keep = [
        c
        for c in previous
        if len(c.tokens) + rounds * (opts.user_tokens + opts.reply_tokens + opts.question_tokens)
        <= c.limit(opts)
    ]
    convs = keep
    if not any(c.kind == "doc" for c in convs):
        convs.append(Conversation(f"doc{run}", "doc", []))
    n = 0
    while sum(1 for c in convs if c.kind == "chat") < opts.chats:
        convs.append(Conversation(f"c{run}.{n}", "chat", []))
        n += 1
    return convs
