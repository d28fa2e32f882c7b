"""Records tesserad's /metrics on the simulated node while workloads run, for the dashboard's
picture (picture.py draws docs/images/dashboard.png from the recording).

    cargo build --workspace
    python3 deploy/monitoring/record.py [--seconds 240] [--out deploy/monitoring/recorded/metrics.om.gz]

A 3 x H100 simulated node: GPU 0 left as it is (shares carved by `tessera alloc`), GPU 1 laid out
as two 3g.40gb MIG devices, GPU 2 whole. Three allocations made through the node API run
tessera-workload under libtessera.so, each seeing only its allocation's devices
(CUDA_VISIBLE_DEVICES, as the hook arranges in a container): a 30% share kept busy (so
throttled), a 50% share that keeps asking past its 4 GiB limit (OOM denials), a MIG device. A
process of the MIG allocation that uses GPU 0 instead is killed (a limit breach); a process
outside any allocation holds memory on GPU 0 for a minute; GPU 2 falls off the bus (XID 79) and
is reset. Every
`--interval` seconds /metrics is scraped; the samples the dashboard queries are written as
OpenMetrics text with their scrape times (instance="<hostname>:9400", job="tesserad", as a
scrape adds them), gzipped. Standard library only.
"""

import argparse
import gzip
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
BIN = ROOT / "target/debug"
# The families the dashboard and the rules read (the rest of a scrape is left out of the file).
KEEP = re.compile(r"^(tessera_|DCGM_FI_DEV_FB_|DCGM_FI_DEV_XID_ERRORS)")
# What a scrape adds (the port is the Helm chart's and the Service's).
LABELS = {"instance": f"{socket.gethostname()}:9400", "job": "tesserad"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse(text, ts, into, types):
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
            continue
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$", line)
        if not m or not KEEP.match(m.group(1)):
            continue
        labels = m.group(2) or "{}"
        extra = ",".join(f'{k}="{v}"' for k, v in LABELS.items())
        labels = "{" + extra + ("," + labels[1:] if labels != "{}" else "}")
        into.setdefault((m.group(1), labels), []).append((ts, m.group(3)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=240)
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--out", default=str(ROOT / "deploy/monitoring/recorded/metrics.om.gz"))
    args = ap.parse_args()
    for b in ["tesserad", "tessera", "tessera-sim", "tessera-workload", "libtessera.so", "libtessera_sim.so"]:
        if not (BIN / b).exists():
            sys.exit(f"{BIN / b} is missing: run cargo build --workspace first")

    tmp = Path(tempfile.mkdtemp(prefix="tessera-record-"))
    node = tmp / "node.toml"
    node.write_text('[[gpu]]\nmodel = "H100-SXM5-80GB"\ncount = 3\n')
    env = dict(os.environ)
    env.update(TESSERA_SIM_NODE=str(node), TESSERA_SIM_STATE=str(tmp / "sim.state"), LD_LIBRARY_PATH=str(tmp / "lib"))
    env.pop("LD_PRELOAD", None)
    subprocess.run([BIN / "tessera-sim", "install", tmp / "lib"], env=env, check=True, stdout=subprocess.DEVNULL)
    port = free_port()
    (tmp / "plugins").mkdir()
    config = tmp / "config.toml"
    config.write_text(
        f'nvml_library = "{BIN / "libtessera_sim.so"}"\n'
        f'device_plugin_dir = "{tmp / "plugins"}"\nstate_dir = "{tmp / "state"}"\n'
        f'runtime_dir = "{tmp / "run"}"\npod_resources_socket = ""\n'
        f'[telemetry]\nmetrics_listen = "127.0.0.1:{port}"\n'
        '[partitions.1]\nmig = { "3g.40gb" = 2 }\n[partitions.2]\nwhole = true\n'
    )
    log = open(tmp / "tesserad.log", "wb")
    procs, allocated = [], []
    daemon = subprocess.Popen([BIN / "tesserad", "--config", config], env=env, stdout=log, stderr=log)
    procs.append(daemon)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(url, timeout=2).read()
                break
            except OSError:
                time.sleep(0.1)
        else:
            sys.exit(f"tesserad did not serve {url}: {(tmp / 'tesserad.log').read_text()}")

        def tessera(*a):
            out = subprocess.run(
                [BIN / "tessera", "--config", config, *a], env=env, check=True, capture_output=True, text=True
            )
            return out.stdout

        def alloc(*a):
            answer = json.loads(tessera("alloc", "--json", *a))
            allocated.append(answer["id"])
            return answer["env"]

        def workload(alloc_env, *a, shim=True, own_device=True):
            e = dict(env)
            if alloc_env is not None:
                e.update(alloc_env)
                if own_device:
                    # What the hook does for a container: only the allocation's devices are seen.
                    e["CUDA_VISIBLE_DEVICES"] = alloc_env["TESSERA_VISIBLE_DEVICES"]
            if shim:
                e["LD_PRELOAD"] = str(BIN / "libtessera.so")
            p = subprocess.Popen([BIN / "tessera-workload", *a], env=e, stdout=subprocess.DEVNULL)
            procs.append(p)
            return p

        trainer = alloc("--memory", "8GiB", "--sm", "30", "--gpu", "0", "--owner", "trainer")
        infer = alloc("--memory", "4GiB", "--sm", "50", "--gpu", "0", "--owner", "infer")
        mig = alloc("--mig", "3g.40gb", "--owner", "batch")
        series, types = {}, {}
        start = time.time()
        events = [
            (20, lambda: workload(trainer, "--alloc-mib", "6000", "--chunk-mib", "500", "--kernel-us", "2000",
                                  "--seconds", str(args.seconds))),
            (30, lambda: workload(mig, "--alloc-mib", "20000", "--kernel-us", "1000", "--rate", "400",
                                  "--seconds", str(args.seconds))),
            # A process of the MIG allocation that ignores its device and takes GPU 0: enforcement
            # kills it (limit_breach; the allocation holds nothing on GPU 0).
            (45, lambda: workload(mig, "--alloc-mib", "2000", "--seconds", "30", own_device=False)),
            (100, lambda: workload(None, "--alloc-mib", "3000", "--seconds", "60", shim=False)),
            (130, lambda: subprocess.run([BIN / "tessera-sim", "inject", "lost", "--gpu", "2"], env=env, check=True)),
            (185, lambda: subprocess.run([BIN / "tessera-sim", "reset", "--gpu", "2"], env=env, check=True)),
        ]
        # The 50% share: a run that asks for 6 GiB in 1 GiB steps (refused past 4 GiB) every 15 s.
        for t in range(60, args.seconds - 10, 15):
            events.append((t, lambda: workload(infer, "--alloc-mib", "6000", "--chunk-mib", "1000",
                                               "--kernel-us", "500", "--rate", "300", "--seconds", "8")))
        events.sort(key=lambda e: e[0])
        next_scrape = start
        while time.time() - start < args.seconds:
            now = time.time()
            while events and events[0][0] <= now - start:
                events.pop(0)[1]()
            if now >= next_scrape:
                text = urllib.request.urlopen(url, timeout=5).read().decode()
                parse(text, round(now, 3), series, types)
                next_scrape += args.interval
            time.sleep(0.05)
    finally:
        # The workloads first, then their allocations released while tesserad still runs (a clean
        # stop keeps the allocations' regions mounted), then tesserad.
        for p in reversed(procs):
            if p is not daemon:
                p.terminate()
        for p in procs:
            if p is not daemon:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
        for id in allocated:
            subprocess.run([BIN / "tessera", "--config", config, "release", id], env=env, capture_output=True)
        daemon.terminate()
        try:
            daemon.wait(timeout=10)
        except subprocess.TimeoutExpired:
            daemon.kill()

    out = []
    for name in sorted({n for n, _ in series}):
        # OpenMetrics counters name their samples <family>_total; a gauge takes any name, and
        # PromQL's rate() does not care which it was.
        out.append(f"# TYPE {name} gauge")
        for (n, labels), points in sorted(series.items()):
            if n == name:
                out += [f"{n}{labels} {v} {ts}" for ts, v in points]
    out.append("# EOF")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(args.out, "wb", mtime=0) as f:
        f.write(("\n".join(out) + "\n").encode())
    print(f"{len(series)} series, {len(out)} lines -> {args.out} ({Path(args.out).stat().st_size} bytes); log {tmp}")


if __name__ == "__main__":
    main()
