# mypy: ignore-errors
"""What ``MLX_CUDA_USE_CUDNN_SDPA=0`` (MLX's cuDNN attention off) costs a long prefill and
decode (gpu15, issue 17; docs/serve.md's Tuning).

Usage: python3 cudnn15.py MODEL OUT.jsonl REPS LENGTHS DECODE
  e.g. python3 cudnn15.py $HOME/smol135m out.jsonl 3 1024,4096,16384,32768 128

REPS pairs of fresh processes, cuDNN attention on (the variable unset) and off
(``MLX_CUDA_USE_CUDNN_SDPA=0``), alternated on/off, off/on, ... Each process loads the
model (``mlx_lm.load``), warms up on a 256-token prompt (kernel loads), then for each
length L of LENGTHS, in order, runs mlx-lm's own ``generate_step`` (the prompt prefilled
in 2,048-token chunks, greedy) on L random token ids drawn from a seed fixed per (pair,
L), so both settings see the same tokens: ``prefill_s`` is the time to the first token
(the prompt's prefill and its first step: a new attention shape, as every turn of a
server has), ``decode_tps`` the rate of the DECODE-1 tokens after it. Then every length
again in the same process (``again``: the same shapes, MLX's cuDNN graphs cached).
One JSON line per process to OUT.jsonl (and stdout); the tokens each greedy decode
produced are kept as a digest (on and off should match). ``CUDNN_PRIME=1``: a first pair
(``pair`` -1, left out of the figures) fills MLX's kernel caches on a fresh machine.
``G15_DEADLINE`` (epoch seconds): no pair is begun that would end after it (a pair's
length guessed as the longest so far, ``CUDNN_PAIR_S`` before the first).
"""

import hashlib
import json
import os
import subprocess
import sys
import time

VAR = "MLX_CUDA_USE_CUDNN_SDPA"


def child(model_path, lengths, decode, pair):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    began = time.perf_counter()
    model, _ = load(model_path)
    loaded = time.perf_counter() - began
    vocab = model.args.vocab_size

    def once(length, seed):
        prompt = mx.random.randint(3, vocab, (length,), key=mx.random.key(seed)).astype(mx.int32)
        mx.eval(prompt)
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        times, tokens = [], []
        for token, _ in generate_step(prompt, model, max_tokens=decode, prompt_cache=cache):
            times.append(time.perf_counter())
            tokens.append(int(token))
        first = times[0] - t0
        tps = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")
        digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:12]
        del cache
        mx.clear_cache()
        return {"L": length, "prefill_s": first, "decode_tps": tps, "tokens": digest}

    warm = once(256, 1)
    runs = [dict(once(n, 1000 * pair + n), again=False) for n in lengths]
    runs += [dict(once(n, 1000 * pair + n), again=True) for n in lengths]
    return {"load_s": loaded, "warmup": warm, "runs": runs, "mlx": mx.__version__}


def main():
    if sys.argv[1] == "--child":
        model_path, lengths, decode, pair = (
            sys.argv[2],
            sys.argv[3],
            int(sys.argv[4]),
            int(sys.argv[5]),
        )
        out = child(model_path, [int(x) for x in lengths.split(",")], decode, pair)
        print("RESULT " + json.dumps(out), flush=True)
        return
    model_path, out_path, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    lengths, decode = sys.argv[4], sys.argv[5]
    deadline = float(os.environ.get("G15_DEADLINE", "inf"))
    longest = float(os.environ.get("CUDNN_PAIR_S", "60"))
    first = -1 if os.environ.get("CUDNN_PRIME") == "1" else 0
    with open(out_path, "a") as out:
        for pair in range(first, reps):
            if time.time() + longest > deadline:
                print(json.dumps({"stopped_before_pair": pair, "longest_s": longest}), flush=True)
                break
            began_pair = time.time()
            order = ("on", "off") if pair % 2 == 0 else ("off", "on")
            for position, setting in enumerate(order):
                env = dict(os.environ)
                env.pop(VAR, None)
                if setting == "off":
                    env[VAR] = "0"
                load, utc = os.getloadavg()[0], time.strftime("%H:%M:%S", time.gmtime())
                t0 = time.perf_counter()
                argv = [sys.executable, __file__, "--child", model_path, lengths, decode]
                try:
                    proc = subprocess.run(
                        [*argv, str(max(pair, 0))],
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=max(10.0, min(300.0, deadline - time.time())),
                    )
                except subprocess.TimeoutExpired:
                    out.write(
                        json.dumps({"pair": pair, "setting": setting, "rc": "timeout"}) + "\n"
                    )
                    return
                wall = time.perf_counter() - t0
                lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                row = {
                    "pair": pair,
                    "setting": setting,
                    "position": position,
                    "load": load,
                    "utc": utc,
                    "wall_s": wall,
                    "rc": proc.returncode,
                }
                if lines:
                    row.update(json.loads(lines[-1][len("RESULT ") :]))
                else:
                    row["stderr"] = proc.stderr[-800:]
                out.write(json.dumps(row) + "\n")
                out.flush()
                brief = [
                    (r["L"], round(1e3 * r["prefill_s"], 1), round(r["decode_tps"]))
                    for r in row.get("runs", [])
                ]
                print(pair, setting, f"{wall:.1f}s", brief, flush=True)
            longest = max(longest if pair > first else 0.0, time.time() - began_pair)


if __name__ == "__main__":
    main()
