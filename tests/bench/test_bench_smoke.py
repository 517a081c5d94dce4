"""`kvtrio bench runtime` runs end to end (a smoke run: figures, not timings, are checked)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def test_bench_runtime_prints_json_figures_and_ratios() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtrio",
            "bench",
            "runtime",
            "--json",
            "--messages",
            "300",
            "--rounds",
            "1",
            "--clock",
            "cpu",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    figures = json.loads(out.stdout)
    for name in ("raw_ping_pong", "ask", "raw_stream", "tell"):
        assert figures[name] > 0, name
    assert figures["ask_ratio"] == figures["ask"] / figures["raw_ping_pong"]
    assert figures["tell_ratio"] == figures["tell"] / figures["raw_stream"]


def test_bench_policy_prints_json_figures_and_headline_ratios() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtrio",
            "bench",
            "policy",
            "--json",
            "--chats",
            "200",
            "--docs",
            "4",
            "--budgets",
            "2:8",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    figures = json.loads(out.stdout)
    assert len(figures["runs"]) == 3 * 4  # eviction policies x admission policies
    for run in figures["runs"]:
        assert 0 < run["saved_share"] <= figures["unbounded"]["saved_share"] + 1e-9, run
        assert run["gib_written"] >= 0 and 0 <= run["reuse_ratio"] <= 1
    (headline,) = figures["headline"]
    runs = {(r["policy"], r["admission"]): r for r in figures["runs"]}
    assert headline["saved_vs_lru"] == (
        runs["cost", "all"]["hours_saved"] / runs["lru", "all"]["hours_saved"]
    )
    assert headline["written_cut"] == (
        runs["cost", "all"]["gib_written"] / runs["cost", "default"]["gib_written"]
    )


def _assert_one_server_at_a_time_in_round_order(runs: dict[str, list[dict[str, Any]]]) -> None:
    """Every round of every server ran on its own process, alive while no other server
    was, the servers of round ``r`` in order (names as given, reversed in odd rounds)."""
    names = list(runs)
    rounds = len(next(iter(runs.values())))
    lives = []
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        assert [runs[name][r]["position"] for name in order] == list(range(len(names)))
        lives += [tuple(runs[name][r]["alive"]) for name in order]
    assert len({run["pid"] for name in names for run in runs[name]}) == len(lives)
    assert all(begin < end for begin, end in lives)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(lives)), lives  # in turn, alone


def test_bench_serve_spill_phase_prints_latencies_and_ratios_of_the_same_run() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtrio", "bench", "serve", "--json", "--phases", "spill",
         "--spill-rounds", "1", "--spill-length", "256", "--spill-tokens", "256"],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    figures = json.loads(out.stdout)
    assert "restart" not in figures and "decode" not in figures  # only the phase asked for
    spill, ratios = figures["spill"], figures["ratios"]["spill"]
    for kind in ("mlx_lm", "naive", "kvtrio", "kvtrio_nosave"):
        assert spill[kind]["samples_during"] > 0, kind
        assert 0 < spill[kind]["itl_p50_ms_during"] <= spill[kind]["itl_max_ms_during"], kind
        # The continuation is a RAM hit on every server: a round measures a save, not a
        # recompute.
        for checked in spill[kind]["rounds"]:
            assert checked["continued_cached_tokens"] >= 256, (kind, checked)
    kv, naive, nosave = spill["kvtrio"], spill["naive"], spill["kvtrio_nosave"]
    # The round ran its servers one at a time, each started afresh, in round order.
    labels = ("mlx_lm", "naive", "kvtrio", "kvtrio_nosave")
    assert [spill[label]["rounds"][0]["position"] for label in labels] == [0, 1, 2, 3]
    _assert_one_server_at_a_time_in_round_order({label: spill[label]["rounds"] for label in labels})
    # kvtrio saved while the stream ran; with room for every entry it saved nothing.
    assert [r["spilled_while_streaming"] for r in kv["rounds"]] != [0]
    assert [r["spilled_while_streaming"] for r in nosave["rounds"]] == [0]
    assert ratios["itl_p99_kvtrio_during_vs_nosave"] == (
        kv["itl_p99_ms_during"] / nosave["itl_p99_ms_during"]
    )
    assert ratios["itl_p99_kvtrio_during_vs_quiet"] == (
        kv["itl_p99_ms_during"] / kv["itl_p99_ms_quiet"]
    )
    assert ratios["itl_p99_naive_vs_kvtrio_during"] == (
        naive["itl_p99_ms_during"] / kv["itl_p99_ms_during"]
    )
    naive_round = naive["rounds"][0]["itl_p99_ms_during"] / kv["rounds"][0]["itl_p99_ms_during"]
    assert ratios["itl_p99_naive_vs_kvtrio_during_per_round"] == [naive_round]
    assert ratios["itl_p99_naive_vs_kvtrio_during_round_median"] == naive_round
    # "While an entry is saved": the naive baseline (on every insert) and kvtrio (what RAM
    # evicted) recorded their saves, the servers that save nothing none; the gaps read
    # while saving are a part of the window's.
    savers = {"naive": True, "kvtrio": True, "mlx_lm": False, "kvtrio_nosave": False}
    for kind, saved in savers.items():
        (checked,) = spill[kind]["rounds"]
        assert (checked["saves"] > 0) is saved, (kind, checked)
        assert len(checked["save_ms"]) == checked["saves"]
        assert all(ms >= 0 for ms in checked["save_ms"])
        assert 0 <= checked["samples_saving"] <= checked["samples"]
        assert (spill[kind]["samples_saving"] > 0) is saved, kind
        assert len(checked["write_ms"]) <= checked["saves"]
        assert 0 <= checked["samples_writing"] <= checked["samples_saving"]
    # Each naive save is its own write, on the generation thread.
    assert naive["rounds"][0]["write_ms"] == naive["rounds"][0]["save_ms"]
    assert kv["rounds"][0]["saves"] >= kv["rounds"][0]["spilled_while_streaming"]
    assert naive["itl_max_ms_saving"] <= naive["itl_max_ms_during"]
    assert ratios["itl_max_naive_vs_kvtrio_saving"] == (
        naive["itl_max_ms_saving"] / kv["itl_max_ms_saving"]
    )


def test_bench_serve_restart_phase_alternates_rounds_and_reports_medians() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtrio", "bench", "serve", "--json", "--phases", "restart",
         "--lengths", "256", "--restart-rounds", "2", "--settle", "0"],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    figures = json.loads(out.stdout)
    restart, ratios = figures["restart"]["256"], figures["ratios"]["256"]
    for kind, positions in (("mlx_lm", [0, 2]), ("naive", [1, 1]), ("kvtrio", [2, 0])):
        runs = restart[kind]["runs"]
        assert [run["position"] for run in runs] == positions, kind  # the order alternates
        assert all(run["ttft_s"] > 0 and "answer" not in run for run in runs), kind
        assert all(run["warmup_s"] is None for run in runs), kind  # no --restart-warmup
        assert restart[kind]["ttft_s"] == (runs[0]["ttft_s"] + runs[1]["ttft_s"]) / 2, kind
        # Every round restarted the server: mlx_lm.server recomputes, the other two load
        # the round's own conversation from disk.
        cached = [run["cached_tokens"] for run in runs]
        assert cached == [0, 0] if kind == "mlx_lm" else min(cached) >= 256, (kind, cached)
    # What explains a round's hit or miss is kept: the SIGTERM after turn 1 wrote every
    # round's entry and shed none; each round found them all on disk, served turn 2 from
    # it, and exited with them still there.
    written = restart["kvtrio"]["turn1_exit"]
    assert written["stopped"]["RAM entries written"] == 2, written
    assert written["cold tier at exit"]["entries"] == 2, written
    assert written["cold tier at exit"]["pending writes dropped"] == 0, written
    for r, run in enumerate(restart["kvtrio"]["runs"]):  # each round adds its turn 2's
        tier = run["tier"]
        assert tier["before"]['kvtrio_cache_entries{tier="cold"}'] == 2 + r, tier
        _served_from_ram_or_disk(tier)
        assert tier["exit"]["cold tier at exit"]["entries"] == 3 + r, tier
    kv, naive, plain = (restart[k]["runs"] for k in ("kvtrio", "naive", "mlx_lm"))
    assert ratios["ttft_kvtrio_vs_naive_per_round"] == [
        a["ttft_s"] / b["ttft_s"] for a, b in zip(kv, naive, strict=True)
    ]
    assert ratios["ttft_kvtrio_vs_naive_round_median"] == (
        sum(ratios["ttft_kvtrio_vs_naive_per_round"]) / 2
    )
    assert ratios["ttft_kvtrio_vs_mlx_lm_per_round"] == [
        a["ttft_s"] / b["ttft_s"] for a, b in zip(kv, plain, strict=True)
    ]
    assert ratios["ttft_kvtrio_vs_naive"] == (
        restart["kvtrio"]["ttft_s"] / restart["naive"]["ttft_s"]
    )
    assert ratios["same_answer_as_mlx_lm_per_round"] == [True, True]
    assert ratios["same_answer_as_mlx_lm"] is True


def test_bench_serve_restart_warmup_answers_one_request_on_every_server_before_turn_2() -> None:
    """With ``--restart-floor`` too: a fourth server, plain mlx_lm.server answering turn 1
    then turn 2 in one process (the floor), its turn 2 a hit in its own RAM."""
    out = subprocess.run(
        [sys.executable, "-m", "kvtrio", "bench", "serve", "--json", "--phases", "restart",
         "--lengths", "256", "--restart-rounds", "1", "--settle", "0", "--restart-warmup",
         "--restart-floor"],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    figures = json.loads(out.stdout)
    restart = figures["restart"]["256"]
    (floor,) = restart["mlx_lm_never_restarted"]["runs"]
    assert floor["cached_tokens"] >= 256 and floor["warmup_s"] > 0
    ratios = figures["ratios"]["256"]
    assert ratios["ttft_kvtrio_vs_never_restarted"] == (
        restart["kvtrio"]["ttft_s"] / restart["mlx_lm_never_restarted"]["ttft_s"]
    )
    for kind in ("mlx_lm", "naive", "kvtrio"):  # every server alike, untimed by the ratios
        (run,) = restart[kind]["runs"]
        assert run["warmup_s"] > 0, kind
        # The warm-up (a plain completion) shares no token with turn 2: the two that
        # persist still load it from disk, mlx_lm.server recomputes all of it.
        cached = run["cached_tokens"]
        assert cached == 0 if kind == "mlx_lm" else cached >= 256, (kind, cached)
    _served_from_ram_or_disk(restart["kvtrio"]["runs"][0]["tier"])


def _served_from_ram_or_disk(tier: dict[str, Any]) -> None:
    """Turn 2 of a kvtrio restart round: from RAM when the warm restart (--settle 0: it
    races turn 2) had loaded its entry back by then, else from disk; the header, the
    lookup counters and the restore's agree. A restore part-way through (some entries
    back, turn 2's not yet) serves it from disk; one that had loaded every disk entry
    back before turn 2 was sent (all fit its budget here) serves it from RAM."""
    restored = tier["before"].get("kvtrio_serve_restored_total", 0)
    on_disk = tier["before"]['kvtrio_cache_entries{tier="cold"}']
    served = {"hot": "ram", "cold": "disk"}[tier["cache_header"]]
    assert tier["after"][f'kvtrio_serve_lookups_total{{served="{served}"}}'] == 1, tier
    assert served == "ram" or restored < on_disk, tier


def test_bench_scale_long_entries_repeated_opens_and_interleaved_misses(tmp_path: Path) -> None:
    """One run of the bench (each run costs fresh processes per open), three promises
    (and ``--dir`` naming a directory not there yet: made):

    - ``--tokens``: entries past one index block (their chain hashes are part of the
      open's index build); every entry is found again at each N, the lookups run;
    - ``--repeat``: K opens per N, every one a fresh process's first open of the cold
      tier (its RSS per entry included), every one's figures kept, the median the figure
      the ratios divide, the spread beside it;
    - the miss ratio the target bounds divides medians taken in one process, every N's
      misses interleaved round by round, each round's median kept for the spread.
    """
    import statistics

    from kvtrio.bench.scale import MISS_ROUNDS

    out = subprocess.run(
        [sys.executable, "-m", "kvtrio", "bench", "scale", "--json", "--sizes", "20,40",
         "--tokens", "200", "--repeat", "3", "--lookups", "40", "--burst", "8",
         "--burst-fit", "4", "--burst-rss", "6", "--burst-cap-mib", "4", "--no-maintenance",
         "--dir", str(tmp_path / "not" / "yet")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    figures = json.loads(out.stdout)
    assert figures["tokens"] == 200
    runs = figures["runs"]
    assert [run["n"] for run in runs.values()] == [20, 40]
    assert figures["burst"]["kept"] <= figures["burst"]["fit"] + 1
    # The burst's memory: capped and uncapped, each its own process; uncapped drops nothing.
    rss = figures["burst_rss"]
    assert rss["uncapped"]["pending_dropped"] == 0
    assert rss["capped"]["cold_entries"] + rss["capped"]["pending_dropped"] >= 6
    assert rss["rss_growth_over_cap_plus_entry"] == rss["capped"]["rss_growth_peak"] / (
        (4 << 20) + rss["entry_bytes"]
    )
    for run in runs.values():
        assert run["repeat"] == 3 and len(run["opens"]) == 3
        walls = [sample["open_s"] for sample in run["opens"]]
        cpus = [sample["open_cpu_s"] for sample in run["opens"]]
        assert all(wall > 0 for wall in walls) and all(cpu > 0 for cpu in cpus)
        assert run["open_s"] == statistics.median(walls)
        assert run["open_cpu_s"] == statistics.median(cpus)
        assert (run["open_s_min"], run["open_s_max"]) == (min(walls), max(walls))
        stalls = [sample["open_stall_s"] for sample in run["opens"]]
        assert run["open_stall_s_max"] == max(stalls)
        # Every sample a restart's open: a fresh process's first, the imports done before.
        assert all(sample["prior_opens"] == 0 for sample in run["opens"])
        assert all(sample["open_new_modules"] == 0 for sample in run["opens"])
        rss = [sample["rss_per_entry"] for sample in run["opens"]]
        assert run["rss_per_entry"] == statistics.median(rss)
    assert figures["open_40_over_20"] == runs["40"]["open_s"] / runs["20"]["open_s"]

    misses = figures["misses"]
    assert sorted(misses) == ["20", "40"]
    for interleaved in misses.values():
        assert interleaved["samples"] == 40 // MISS_ROUNDS * MISS_ROUNDS
        assert len(interleaved["round_p50s"]) == MISS_ROUNDS
        assert 0 < interleaved["p50_s"] <= interleaved["p99_s"]
    small, large = misses["20"], misses["40"]
    assert figures["miss_p50_largest_over_smallest"] == large["p50_s"] / small["p50_s"]
    per_round = [a / b for a, b in zip(large["round_p50s"], small["round_p50s"], strict=True)]
    assert figures["miss_ratio_rounds_min"] == min(per_round)
    assert figures["miss_ratio_rounds_max"] == max(per_round)


def test_bench_scale_repeats_every_open_up_to_100k_by_default() -> None:
    """Five fresh-process opens per N up to 100,000 (one sample of 100,000 swung by 1.6x
    on a shared VM: enough to swing the ratio alone), one at a million."""
    from kvtrio.bench.scale_opens import repeats

    assert [repeats(n, None) for n in (1000, 10_000, 100_000)] == [5, 5, 5]
    assert repeats(1_000_000, None) == 1
    assert repeats(100_000, 2) == 2
    with pytest.raises(ValueError):
        repeats(1000, 0)


def test_steady_rate_counts_only_the_window_where_every_stream_decodes() -> None:
    from kvtrio.bench.serve_harness import steady_rate

    # Two streams: one from 0 to 10 s, one from 2 to 6 s: the window is (2, 6].
    a = [float(t) for t in range(11)]
    b = [2.0, 3.0, 4.0, 5.0, 6.0]
    assert steady_rate([a, b]) == (4 + 4) / 4.0
    assert steady_rate([a, [20.0, 21.0]]) == 0.0  # never decoding together
    assert steady_rate([a, [1.0]]) == 0.0


def test_paired_rounds_count_the_rounds_a_server_was_lower_with_their_sign_test() -> None:
    from kvtrio.bench.serve_harness import paired, sign_test_p

    runs = [{"s": 1.0}, {"s": 3.0}, {"s": 2.0}]
    references = [{"s": 2.0}, {"s": 2.0}, {"s": 4.0}]
    assert paired(runs, references, "s") == {
        "per_round": [0.5, 1.5, 0.5],
        "round_median": 0.5,
        "lower_rounds": 2,
        "rounds": 3,
        "lower_sign_test_p": (3 + 1) / 8,  # 2 or 3 of 3 lower by chance
    }
    assert sign_test_p(10, 10) == 1 / 1024
    assert sign_test_p(0, 7) == 1.0 and sign_test_p(0, 0) == 1.0
    with pytest.raises(ValueError):  # every round must have its reference
        paired(runs, references[:2], "s")


def test_the_serve_bench_starts_servers_from_kvtrios_bytecode() -> None:
    """Under PYTHONDONTWRITEBYTECODE an editable kvtrio has no bytecode, and its servers
    paid a compile of its modules at every start; the bench writes it first."""
    import importlib.util
    from pathlib import Path

    import kvtrio.serve.server
    from kvtrio.bench.serve_harness import compile_kvtrio

    assert compile_kvtrio()
    source = kvtrio.serve.server.__file__
    assert source is not None
    cached = Path(importlib.util.cache_from_source(source))
    assert cached.stat().st_mtime_ns >= Path(source).stat().st_mtime_ns


def test_bench_serve_decode_phase_alternates_rounds_and_reports_medians() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtrio", "bench", "serve", "--json", "--phases", "decode",
         "--rounds", "2", "--decode-tokens", "24", "--streams", "2"],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    figures = json.loads(out.stdout)
    decode, ratios = figures["decode"], figures["ratios"]["decode"]
    for kind, positions in (("mlx_lm", [0, 2]), ("naive", [1, 1]), ("kvtrio", [2, 0])):
        runs = decode[kind]["runs"]
        assert len(runs) == 2 and all(run["tok_s_1"] > 0 and run["tok_s_2"] > 0 for run in runs)
        assert all(run["tok_s_2_steady"] >= 0 for run in runs)
        assert decode[kind]["tok_s_2"] == (runs[0]["tok_s_2"] + runs[1]["tok_s_2"]) / 2
        # Each round started the servers afresh, one at a time, in the order it measured
        # them (reversed every other round): with all three running, the server started
        # first decoded faster on the H200.
        assert [run["position"] for run in runs] == positions, kind
        assert runs[0]["pid"] != runs[1]["pid"], kind
        assert not {"position", "pid", "alive"} & set(decode[kind]), kind
    _assert_one_server_at_a_time_in_round_order(
        {kind: decode[kind]["runs"] for kind in ("mlx_lm", "naive", "kvtrio")}
    )
    assert (
        ratios["tok_s_2_kvtrio_vs_mlx_lm"]
        == decode["kvtrio"]["tok_s_2"] / decode["mlx_lm"]["tok_s_2"]
    )
    kv, plain = decode["kvtrio"]["runs"], decode["mlx_lm"]["runs"]
    per_round = [a["tok_s_1"] / b["tok_s_1"] for a, b in zip(kv, plain, strict=True)]
    assert ratios["tok_s_1_kvtrio_vs_mlx_lm_per_round"] == per_round
    assert ratios["tok_s_1_kvtrio_vs_mlx_lm_round_median"] == sum(per_round) / 2
    assert len(ratios["tok_s_2_kvtrio_vs_mlx_lm_per_round"]) == 2
    # The start-order effect of the run: mlx_lm was started first in round 0, last in 1.
    first_vs_last = (plain[0]["tok_s_1"] / plain[1]["tok_s_1"], kv[1]["tok_s_1"] / kv[0]["tok_s_1"])
    assert (
        ratios["tok_s_1_mlx_lm_started_first_vs_last"],
        ratios["tok_s_1_kvtrio_started_first_vs_last"],
    ) == first_vs_last
    assert decode["kvtrio"]["spilled_during_rounds"] >= 0


def test_bench_serve_start_phase_alternates_rounds_and_reports_per_round_ratios() -> None:
    from kvtrio.bench.serve_harness import sign_test_p

    out = subprocess.run(
        [sys.executable, "-m", "kvtrio", "bench", "serve", "--json", "--phases", "start",
         "--entries", "12", "--start-rounds", "2"],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    figures = json.loads(out.stdout)
    starts, ratios = figures["start_with_12_entries"], figures["ratios"]["start_with_12_entries"]
    for kind, positions in (("mlx_lm", [0, 2]), ("naive", [1, 1]), ("kvtrio", [2, 0])):
        runs = starts[kind]["runs"]
        assert [run["position"] for run in runs] == positions, kind  # the order alternates
        assert all(0 < run["listen_s"] < run["answer_s"] for run in runs), kind
        assert starts[kind]["answer_s"] == (runs[0]["answer_s"] + runs[1]["answer_s"]) / 2
    kv, naive = starts["kvtrio"]["runs"], starts["naive"]["runs"]
    per_round = [a["answer_s"] / b["answer_s"] for a, b in zip(kv, naive, strict=True)]
    assert ratios["first_answer_kvtrio_vs_naive_per_round"] == per_round
    assert ratios["first_answer_kvtrio_vs_naive_round_median"] == sum(per_round) / 2
    assert ratios["first_answer_kvtrio_vs_naive"] == (
        starts["kvtrio"]["answer_s"] / starts["naive"]["answer_s"]
    )
    listen = [a["listen_s"] / b["listen_s"] for a, b in zip(kv, naive, strict=True)]
    assert ratios["listen_kvtrio_vs_naive_per_round"] == listen
    lower = sum(1 for ratio in per_round if ratio < 1)
    assert ratios["first_answer_kvtrio_vs_naive_lower_rounds"] == lower
    assert ratios["first_answer_kvtrio_vs_naive_lower_sign_test_p"] == sign_test_p(lower, 2)
    mlx_lm = starts["mlx_lm"]["runs"]
    plain = [a["answer_s"] / b["answer_s"] for a, b in zip(mlx_lm, naive, strict=True)]
    assert ratios["first_answer_mlx_lm_vs_naive_per_round"] == plain  # the control
    cpu = [a["cpu_s"] / b["cpu_s"] for a, b in zip(kv, naive, strict=True)]
    assert ratios["first_answer_cpu_kvtrio_vs_naive_per_round"] == cpu
    assert all(0 < run["cpu_s"] for kind in starts.values() for run in kind["runs"])
    assert figures["kvtrio_bytecode"] is True
