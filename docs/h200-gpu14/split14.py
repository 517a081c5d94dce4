# mypy: ignore-errors
"""Where turn 2's time goes over a RAM hit, in process (gpu14, issue 17).

    python3 split14.py MODEL OUT.jsonl [ROUNDS] [SCENARIO ...]

The driver (this process) builds the bench's 4k conversation as ``kvtrio bench serve``'s
restart phase does (``prompt_words(model, 4096)``, "Conversation 0. <document>", turn 1
answered with 8 greedy tokens through mlx-lm's BatchGenerator, turn 2 = turn 1 + the
answer + ``QUESTION``), saves turn 1's cache (prompt + answer, as mlx_lm.server inserts
it) with mlx-lm's ``save_prompt_cache``, and then runs each scenario in a fresh worker
process (``--worker``), ROUNDS times, scenarios alternated. A worker imports first, says
so, and waits for the driver's go before it touches the GPU; the next worker imports
meanwhile (imports off the clock, one measuring at a time).

A worker loads the model and the entry (a RAM entry in kvtrio's adapter, RAM only), runs
the scenario's warm-up (none; ``rule5``: kvtrio.serve.restore.warm_up from the tree on
PYTHONPATH, as kvtrio serve runs it after a restore (on main); ``rule5b``: the same with
``batched=True``, as kvtrio serve runs it on branch gpu14 (its tree needed); ``batch``:
the same 16 tokens through mlx-lm's batch path, a BatchKVCache with its array mask, plus
one decode step; ``prompt``: a short unrelated prompt through a BatchGenerator, as the
bench's --restart-warmup request), then turn 2 as mlx_lm.server's generation thread runs
it, every stage ended by ``mx.synchronize()``: the chat template + tokenize; the
adapter's lookup (a RAM hit: deep copy, trim); its copy evaluated; ``insert_segments``;
each ``BatchGenerator.next()`` until the first generated token (the first: merge into a
BatchKVCache + the 55-token prefill; the end-of-segment extract + insert as the server
does; the second: the split into a GenerationBatch and its first decode step). Then the
same turn again (``again``, 3 times), turn 2 with other shapes (``shape``: more tokens
to prefill over the same total, or the same over a shorter cache), the direct path
(``direct``: model calls on a KVCache, no batch cache), and
``mx.fast.scaled_dot_product_attention`` alone on new shapes (``sdpa``: the first call
of a shape against its second). Scenario names ending in ``-nocudnn`` run with
``MLX_CUDA_USE_CUDNN_SDPA=0``.

One JSON line per worker to OUT.jsonl; a table of medians (ms) printed at the end.
"""

import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

QUESTION = "Please summarise the document above in one sentence."
WARMUP = "Warm-up request: say hello."
SCENARIOS = ["none", "rule5", "batch", "prompt", "rule5-nocudnn", "none-nocudnn"]


# -- worker ----------------------------------------------------------------------------


def worker(model_dir, prep, scenario):
    import mlx.core as mx
    from kvtrio.serve.adapter import TieredLRUPromptCache
    from kvtrio.serve.restore import warm_up
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator, _merge_caches
    from mlx_lm.models import cache as mlx_cache

    print("imported", flush=True)
    sys.stdin.readline()  # the driver's go: the previous worker has exited
    out = {
        "scenario": scenario,
        "pid": os.getpid(),
        "utc": time.strftime("%H:%M:%S", time.gmtime()),
    }
    out["load1"] = os.getloadavg()[0]
    out["mlx"] = f"{mx.__version__} {mx.default_device()}"
    t = time.perf_counter()
    model, tokenizer = load(model_dir)
    mx.eval(model.parameters())
    out["model_load_ms"] = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    entry = mlx_cache.load_prompt_cache(prep["entry_file"])
    mx.eval([c.state for c in entry])
    mx.synchronize()
    out["entry_load_ms"] = (time.perf_counter() - t) * 1e3
    key = ("model", None, None)
    adapter = TieredLRUPromptCache(max_size=10, tier_model=key)  # warm_up reads tier_model
    entry_tokens = prep["entry_tokens"]
    adapter.insert_cache(key, list(entry_tokens), entry, cache_type="assistant")
    del entry
    sink = TieredLRUPromptCache(max_size=2)  # the turns' own inserts (RAM keeps one entry)
    stream = mx.default_stream(mx.default_device())

    def clock():
        mx.synchronize()
        return time.perf_counter()

    # -- the warm-up -------------------------------------------------------------------
    t = clock()
    kind = scenario.split("-")[0]
    if kind == "rule5":  # main's warm-up (one model call)
        out["warm_s"] = warm_up(adapter, model, tuple(entry_tokens))
    elif kind == "rule5b":  # gpu14's: the turn through a BatchGenerator (batched=True)
        out["warm_s"] = warm_up(adapter, model, tuple(entry_tokens), batched=True)
    elif kind == "batch":
        caches = copy.deepcopy(adapter._trie.get(key, list(entry_tokens)).prompt_cache)
        mlx_cache.trim_prompt_cache(caches, 16)
        batch = _merge_caches([caches])
        mx.eval(model(mx.array([entry_tokens[-16:]]), cache=batch))
        mx.eval(mx.argmax(model(mx.array([[entry_tokens[-1]]]), cache=batch)[:, -1], axis=-1))
    elif kind == "prompt":
        bg = BatchGenerator(model, stream=stream)
        (_uid,) = bg.insert([tokenizer.encode(WARMUP)], max_tokens=[8])
        while True:
            _, gen = bg.next()
            if any(r.finish_reason for r in gen):
                break
        bg.close()
    out["warmup_ms"] = (clock() - t) * 1e3

    messages2 = prep["messages2"]

    def turn2(drop_cached=0, drop_tail=0):
        """One turn 2 as mlx_lm.server's generation thread runs it; per-stage ms."""
        st = {}
        t0 = clock()
        prompt = tokenizer.apply_chat_template(messages2, add_generation_prompt=True, tokenize=True)
        prompt = list(prompt)
        t1 = clock()
        st["template_tokenize"] = (t1 - t0) * 1e3
        st["prompt_tokens"] = len(prompt)
        if drop_tail:
            prompt = prompt[:-drop_tail]
        cache, rest = adapter.fetch_nearest_cache(key, prompt)
        t2 = clock()
        st["lookup"] = (t2 - t1) * 1e3
        if drop_cached:
            mlx_cache.trim_prompt_cache(cache, drop_cached)
            rest = prompt[len(prompt) - len(rest) - drop_cached :]
        st["cached"] = len(prompt) - len(rest)
        mx.eval([c.state for c in cache])
        t3 = clock()
        st["copy_eval"] = (t3 - t2) * 1e3
        bg = BatchGenerator(model, stream=stream)
        (_uid,) = bg.insert_segments(
            segments=[[rest]], max_tokens=[8], caches=[cache], all_tokens=[prompt[: st["cached"]]]
        )
        del cache
        t4 = clock()
        st["insert_segments"] = (t4 - t3) * 1e3
        steps, n = [], 0
        last = t4
        while True:
            n += 1
            prompt_resp, gen = bg.next()
            now = clock()
            steps.append(round((now - last) * 1e3, 3))
            last = now
            ends = [r.uid for r in prompt_resp if r.end_of_segment and not r.end_of_prompt]
            if ends:  # the server's extract + insert at the end of a segment
                for _u, (c, toks) in bg.extract_cache(ends).items():  # into a second
                    sink.insert_cache(key, toks[:], c, cache_type="user")  # adapter: RAM stays
                now = clock()
                st["segment_insert"] = (now - last) * 1e3
                last = now
            if gen or n > 20:
                break
        st["next_ms"] = steps
        st["first_token"] = (last - t0) * 1e3
        st["after_tokenize"] = (last - t1) * 1e3
        bg.close()
        return st

    out["turn2"] = turn2()
    out["again"] = [turn2() for _ in range(3)]
    out["shape"] = [turn2(drop_cached=k) for k in (1, 2)] + [turn2(drop_tail=k) for k in (1, 2)]

    def direct(drop_cached):
        prompt = prep["prompt2"]
        cache, rest = adapter.fetch_nearest_cache(key, prompt)
        mlx_cache.trim_prompt_cache(cache, drop_cached)
        rest = prompt[len(prompt) - len(rest) - drop_cached :]
        mx.eval([c.state for c in cache])
        t0 = clock()
        mx.eval(model(mx.array([rest[:-1]]), cache=cache))
        t1 = clock()
        y = mx.argmax(model(mx.array([rest[-1:]]), cache=cache)[:, -1], axis=-1)
        y.item()
        t2 = clock()
        return {"prefill": (t1 - t0) * 1e3, "decode": (t2 - t1) * 1e3, "q": len(rest) - 1}

    out["direct"] = [direct(k) for k in (3, 3, 4)]
    # mx.fast.scaled_dot_product_attention alone: new shapes, causal and with a bool mask.
    sd = []
    nq, nkv, hd = prep["heads"]
    for q_len, k_len, masked in (
        (40, 3000, False),
        (40, 3001, False),
        (41, 3000, True),
        (41, 3001, True),
    ):
        q = mx.random.normal((1, nq, q_len, hd)).astype(mx.float16)
        k = mx.random.normal((1, nkv, k_len, hd)).astype(mx.float16)
        v = mx.random.normal((1, nkv, k_len, hd)).astype(mx.float16)
        mask = "causal"
        if masked:
            mask = (mx.arange(k_len - q_len, k_len)[:, None] >= mx.arange(k_len)[None])[None, None]
        mx.eval(q, k, v, mask if masked else q)
        times = []
        for _ in range(2):
            t0 = clock()
            mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=hd**-0.5, mask=mask))
            times.append((clock() - t0) * 1e3)
        sd.append({"q": q_len, "k": k_len, "mask": "bool" if masked else "causal", "ms": times})
    out["sdpa"] = sd
    print(json.dumps(out), flush=True)


# -- driver ----------------------------------------------------------------------------


def prepare(model_dir, work):
    import mlx.core as mx
    from kvtrio.bench.serve_harness import prompt_words
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models import cache as mlx_cache

    model, tokenizer = load(str(model_dir))
    document = prompt_words(Path(model_dir), 4096)
    messages1 = [{"role": "user", "content": f"Conversation 0. {document}"}]
    prompt1 = list(
        tokenizer.apply_chat_template(messages1, add_generation_prompt=True, tokenize=True)
    )
    bg = BatchGenerator(model)
    (_uid,) = bg.insert([prompt1], max_tokens=[8])
    answer, entry = [], None
    while entry is None:
        _, gen = bg.next()
        for r in gen:
            if r.finish_reason != "stop":
                answer.append(r.token)
            if r.finish_reason is not None:
                entry, entry_tokens = r.prompt_cache, list(r.all_tokens)
    bg.close()
    text = tokenizer.decode(answer)
    messages2 = [
        *messages1,
        {"role": "assistant", "content": text},
        {"role": "user", "content": QUESTION},
    ]
    prompt2 = list(
        tokenizer.apply_chat_template(messages2, add_generation_prompt=True, tokenize=True)
    )
    entry_file = str(work / "entry.safetensors")
    mx.eval([c.state for c in entry])
    mlx_cache.save_prompt_cache(entry_file, entry)
    common = next(
        (i for i, (a, b) in enumerate(zip(entry_tokens, prompt2, strict=False)) if a != b),
        min(len(prompt2), len(entry_tokens)),
    )
    args = model.args
    heads = (
        args.num_attention_heads,
        args.num_key_value_heads,
        args.hidden_size // args.num_attention_heads,
    )
    prep = {
        "entry_file": entry_file,
        "entry_tokens": entry_tokens,
        "messages2": messages2,
        "prompt2": prompt2,
        "prompt1_tokens": len(prompt1),
        "common_prefix": common,
        "answer": text,
        "heads": heads,
    }
    (work / "prep.json").write_text(json.dumps(prep))
    return prep


def driver(model_dir, out_path, rounds, scenarios):
    out_path = Path(out_path)
    work = out_path.parent / "split14-work"
    work.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    prep = prepare(model_dir, work)
    print(
        json.dumps(
            {
                "prepared_s": round(time.perf_counter() - t, 2),
                "prompt1": prep["prompt1_tokens"],
                "entry_tokens": len(prep["entry_tokens"]),
                "prompt2": len(prep["prompt2"]),
                "common_prefix": prep["common_prefix"],
                "answer": prep["answer"],
            }
        ),
        flush=True,
    )
    order = ["prime"] + [
        s for r in range(rounds) for s in (scenarios if r % 2 == 0 else scenarios[::-1])
    ]

    def spawn(scenario):
        env = dict(os.environ)
        if scenario.endswith("-nocudnn"):
            env["MLX_CUDA_USE_CUDNN_SDPA"] = "0"
        argv = [
            sys.executable,
            __file__,
            "--worker",
            str(model_dir),
            str(work / "prep.json"),
            scenario.replace("prime", "none"),
        ]
        p = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )
        return p

    results = []
    ahead = 3  # workers importing while one measures (16 CPUs there)
    pending = [spawn(s) for s in order[:ahead]]
    with out_path.open("a") as out:
        for i, scenario in enumerate(order):
            p = pending.pop(0)
            line = p.stdout.readline()
            if line.strip() != "imported":
                raise SystemExit(f"worker {scenario}: {line!r} rc={p.wait()}")
            p.stdin.write("go\n")
            p.stdin.flush()
            if i + ahead < len(order):  # the next ones import while this one measures
                pending.append(spawn(order[i + ahead]))
            text = p.stdout.read()
            rc = p.wait()
            if rc != 0 or not text.strip():
                print(f"worker {scenario} failed rc={rc}", flush=True)
                continue
            row = json.loads(text.strip().splitlines()[-1])
            row["scenario"] = scenario
            out.write(json.dumps(row) + "\n")
            out.flush()
            results.append(row)
            tt = row["turn2"]
            print(
                f"{scenario:14s} warm {row['warmup_ms']:7.1f} turn2 {tt['first_token']:7.1f} ms "
                f"next {tt['next_ms']} again {[round(a['first_token'], 1) for a in row['again']]}",
                flush=True,
            )
    summary(results)


def summary(results):
    def med(xs):
        return statistics.median(xs) if xs else float("nan")

    stages = [
        "template_tokenize",
        "lookup",
        "copy_eval",
        "insert_segments",
        "segment_insert",
        "first_token",
    ]
    print("median ms by scenario (rows without the prime):")
    print(
        f"{'scenario':14s} {'n':>2s} {'warmup':>7s} "
        + " ".join(f"{s[:10]:>10s}" for s in stages)
        + " next1 next2 | again shapes | direct pre/dec"
    )
    for scenario in dict.fromkeys(r["scenario"] for r in results):
        rows = [r for r in results if r["scenario"] == scenario]
        cells = [med([r["turn2"].get(s, 0.0) for r in rows]) for s in stages]
        n1 = med([r["turn2"]["next_ms"][0] for r in rows])
        n2 = med([r["turn2"]["next_ms"][1] for r in rows if len(r["turn2"]["next_ms"]) > 1])
        again = med([a["first_token"] for r in rows for a in r["again"]])
        shapes = med([a["first_token"] for r in rows for a in r["shape"]])
        pre = med([d["prefill"] for r in rows for d in r["direct"][:1]])
        dec = med([d["decode"] for r in rows for d in r["direct"][:1]])
        print(
            f"{scenario:14s} {len(rows):2d} {med([r['warmup_ms'] for r in rows]):7.1f} "
            + " ".join(f"{c:10.2f}" for c in cells)
            + f" {n1:6.1f} {n2:6.1f} | {again:6.1f} {shapes:6.1f} | {pre:6.1f} {dec:6.1f}"
        )
    print("sdpa alone, first / second call, ms (medians over a scenario's workers):")
    for scenario in dict.fromkeys(r["scenario"] for r in results):
        rows = [r["sdpa"] for r in results if r["scenario"] == scenario]
        cells = [
            f"q{d['q']} k{d['k']} {d['mask']}: {med([x[i]['ms'][0] for x in rows]):.2f} / "
            f"{med([x[i]['ms'][1] for x in rows]):.2f}"
            for i, d in enumerate(rows[0])
        ]
        print(f"  {scenario:14s} " + "; ".join(cells))


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(sys.argv[2], json.loads(Path(sys.argv[3]).read_text()), sys.argv[4])
    else:
        names = [a for a in sys.argv[4:]] or SCENARIOS
        driver(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 2, names)
