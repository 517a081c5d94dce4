# mypy: ignore-errors
"""kvtrio serve with PyTorch kept out, with --import-torch, and mlx_lm.server: seconds from
the command to the first answer (a 3-token chat at temperature 0) on the tiny model, the
three in turn, the order reversed every other round; one JSON line a round.

Run with an installed PyTorch on PYTHONPATH (on the VM: `pip install --target
/tmp/torchsite torch==2.13.0`, the CPU build; the servers inherit PYTHONPATH):

    PYTHONPATH=/tmp/torchsite .venv/bin/python docs/notorch16/start.py ROUNDS WORKDIR
"""

import json
import os
import subprocess
import sys
import time
import urllib.request

from kvtrio.serve.modeldir import write_tiny_model_dir
from kvtrio.tests.serve.servers import free_port

ROUNDS, WORK = int(sys.argv[1]), sys.argv[2]
MODEL = WORK + "/model"
if not os.path.exists(MODEL):
    write_tiny_model_dir(MODEL)
BODY = json.dumps(
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
).encode()


def once(extra):
    """Seconds from the command to the first answer, and the answer's text."""
    port = free_port()
    if extra is None:
        argv = [sys.executable, "-m", "mlx_lm", "server", "--model", MODEL, "--port", str(port)]
    else:
        argv = [sys.executable, "-m", "kvtrio", "serve", "--model", MODEL, "--port", str(port)]
        argv += ["--cache-dir", f"{WORK}/cache{port}", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    request = urllib.request.Request(url, BODY, {"Content-Type": "application/json"})
    while True:
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                out = json.loads(response.read())
            break
        except OSError:
            if proc.poll() is not None:
                sys.exit(proc.stderr.read().decode()[-2000:])
            time.sleep(0.02)
    seconds = time.perf_counter() - t0
    proc.terminate()
    proc.wait(30)
    return seconds, out["choices"][0]["message"]["content"]


for r in range(ROUNDS):
    order = [("hidden", []), ("import-torch", ["--import-torch"]), ("mlx_lm", None)]
    if r % 2:
        order.reverse()
    row = {}
    for name, extra in order:
        row[name], row[name + "_text"] = once(extra)
    row["load"] = open("/proc/loadavg").read().split()[:3]
    print(json.dumps(row), flush=True)
