# mypy: ignore-errors
# ruff: noqa  (a probe kept as it ran: docs/bench/scale.md, open13)
import json
import sys

for f in sys.argv[1:]:
    d = json.load(open(f))
    r = d["runs"]

    def g(n, k):
        return r[str(n)].get(k)

    opens = {n: g(n, "open_s") for n in (1000, 10000, 100000)}
    cpu100 = g(100000, "open_cpu_s")
    loads = [o.get("load_1m") for n in (100000,) for o in r[str(n)].get("opens", [])]
    print(
        f"{f.split('/')[-1]}: open {opens[1000]:.3f}/{opens[10000]:.3f}/{opens[100000]:.3f} (100k cpu {cpu100:.3f}) "
        f"10k/1k {d['open_10000_over_1000']:.2f} 100k/10k {d['open_100000_over_10000']:.2f} (cpu {d['open_cpu_100000_over_10000']:.2f}; rounds {d['open_100000_over_10000_rounds_min']:.2f}-{d['open_100000_over_10000_rounds_max']:.2f}) "
        f"stall {g(1000, 'open_stall_s') * 1e3:.1f}/{g(10000, 'open_stall_s') * 1e3:.1f}/{g(100000, 'open_stall_s') * 1e3:.1f} maxstall100k {g(100000, 'open_stall_s_max') * 1e3:.1f} "
        f"rss/e {g(100000, 'rss_per_entry'):.0f} rebuild_stall {g(1000, 'rebuild_stall_s') * 1e3:.1f}/{g(10000, 'rebuild_stall_s') * 1e3:.1f}/{g(100000, 'rebuild_stall_s') * 1e3:.1f} "
        f"rebuild100k {g(100000, 'rebuild_s'):.1f}s cpu {g(100000, 'rebuild_cpu_s'):.1f} miss {d['miss_p50_largest_over_smallest']:.2f} "
        f"burst {d['burst_max_disk_over_budget']:.3f},{d['burst_kept_over_fit']:.3f} loads {loads}"
    )
