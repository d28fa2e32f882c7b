"""Draws the dashboard as Grafana would show it, from recorded series: docs/images/dashboard.png.

    target/monitoring/bin/python deploy/monitoring/picture.py [RECORDING] [--out PNG]

RECORDING (default deploy/monitoring/recorded/metrics.om.gz, made by record.py) is loaded into a
throwaway Prometheus (`promtool tsdb create-blocks-from openmetrics`, then `prometheus` on the
blocks, on a loopback port); every panel's own queries from tessera-dashboard.json, and its
annotations, are run there over the recording's time range (variables set to all, and
$__rate_interval to 30s), and drawn with matplotlib at the panels' places. Needs promtool and
prometheus (Debian's prometheus package) and target/monitoring (scripts/deps.sh).
"""

import argparse
import gzip
import json
import re
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
BG, PANEL, TEXT, GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"
COLORS = ["#73bf69", "#f2cc0c", "#5794f2", "#ff9830", "#f2495c", "#b877d9", "#8ab8ff", "#ffcb7d", "#96d98d", "#ca95e5"]
ANNOTATION_COLORS = {"orange": "#ff9830", "red": "#f2495c", "purple": "#b877d9", "green": "#73bf69"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, recording, tmp):
        om = tmp / "metrics.om"
        om.write_bytes(gzip.decompress(recording.read_bytes()))
        data = tmp / "data"
        subprocess.run(
            ["promtool", "tsdb", "create-blocks-from", "openmetrics", str(om), str(data)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        times = [float(line.rsplit(" ", 1)[1]) for line in om.read_text().splitlines() if not line.startswith("#")]
        self.start, self.end = min(times), max(times)
        (tmp / "prometheus.yml").write_text("global:\n  scrape_interval: 5s\n")
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={data}",
                "--storage.tsdb.retention.time=100y",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(tmp / "prometheus.log", "wb"),
        )
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1)
                return
            except OSError:
                time.sleep(0.1)
        raise SystemExit(f"prometheus did not start: {(tmp / 'prometheus.log').read_text()}")

    def query(self, expr, instant=False):
        expr = (
            expr.replace("$__rate_interval", "30s")
            .replace("$__range", f"{int(self.end - self.start)}s")
            .replace("$instance", ".*")
            .replace("$namespace", ".*")
            .replace("$pod", ".*")
        )
        if instant:
            params = {"query": expr, "time": self.end}
            path = "query"
        else:
            params = {"query": expr, "start": self.start, "end": self.end, "step": 5}
            path = "query_range"
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?" + urllib.parse.urlencode(params)
        body = json.load(urllib.request.urlopen(url, timeout=30))
        if body.get("status") != "success":
            raise SystemExit(f"{expr}: {body}")
        return body["data"]["result"]

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def legend(fmt, labels):
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt or "")
    # A container the kubelet did not name (an allocation of the node API) has no namespace or pod.
    return re.sub(r"^/\s*", "", text.replace(" /", "").strip()) or "value"


def when(ts):
    return datetime.fromtimestamp(float(ts), tz=timezone.utc)


def fmt_value(v, unit):
    if unit == "bytes":
        for u, s in [(1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")]:
            if abs(v) >= u:
                return f"{v / u:.3g} {s}"
        return f"{v:.0f} B"
    if unit == "percent":
        return f"{v:.0f}%"
    if unit == "percentunit":
        return f"{v * 100:.0f}%"
    if unit == "ops":
        return f"{v:.3g}/s"
    return f"{v:.4g}"


def style(ax, title):
    ax.set_facecolor(PANEL)
    for s in ax.spines.values():
        s.set_color(GRID)
    ax.tick_params(colors=TEXT, labelsize=7)
    ax.set_title(title, color=TEXT, fontsize=9, loc="left", pad=4)


def draw_series(ax, panel, prom, marks):
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
    i = 0
    for t in panel["targets"]:
        for r in prom.query(t["expr"]):
            xs = [when(ts) for ts, _ in r["values"]]
            ys = [float(v) for _, v in r["values"]]
            ax.plot(xs, ys, lw=1.2, color=COLORS[i % len(COLORS)], label=legend(t.get("legendFormat"), r["metric"]))
            i += 1
    for x, color in marks:
        ax.axvline(x, color=color, lw=0.8, ls="--", alpha=0.8)
    ax.grid(color=GRID, lw=0.5)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: fmt_value(v, unit)))
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    ax.set_xlim(when(prom.start), when(prom.end))
    if i:
        leg = ax.legend(fontsize=6, loc="upper left", ncol=2, frameon=False, labelcolor=TEXT)
        leg.set_in_layout(False)
    else:
        ax.text(0.5, 0.5, "No data", color=TEXT, ha="center", va="center", transform=ax.transAxes)


def draw_stat(ax, panel, prom):
    r = prom.query(panel["targets"][0]["expr"], instant=True)
    v = float(r[0]["value"][1]) if r else 0.0
    steps = panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps", [])
    color = TEXT
    for s in steps:
        if s.get("value") is None or v >= s["value"]:
            color = {"green": "#73bf69", "red": "#f2495c", "blue": "#5794f2"}.get(s["color"], s["color"])
    ax.text(0.5, 0.42, f"{v:.0f}", color=color, fontsize=22, ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def draw_timeline(ax, panel, prom):
    mapping = {}
    for m in panel.get("fieldConfig", {}).get("defaults", {}).get("mappings", []):
        for k, o in m.get("options", {}).items():
            mapping[float(k)] = ({"green": "#73bf69", "red": "#f2495c"}.get(o["color"], o["color"]), o["text"])
    rows = []
    for t in panel["targets"]:
        for r in prom.query(t["expr"]):
            rows.append((legend(t.get("legendFormat"), r["metric"]), r["values"]))
    rows.sort()
    for i, (name, values) in enumerate(rows):
        for (ts, v), nxt in zip(values, values[1:] + [(prom.end, None)]):
            color = mapping.get(float(v), ("#888888", v))[0]
            start, width = mdates.date2num(when(ts)), mdates.date2num(when(nxt[0])) - mdates.date2num(when(ts))
            ax.broken_barh([(start, width)], (i - 0.4, 0.8), color=color)
    ax.set_yticks(range(len(rows)), [n for n, _ in rows], fontsize=6)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.invert_yaxis()
    ax.xaxis_date()
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    ax.set_xlim(when(prom.start), when(prom.end))


def draw_table(ax, panel, prom):
    t = panel["targets"][0]
    result = prom.query(t["expr"], instant=True)
    organize = next((x["options"] for x in panel.get("transformations", []) if x["id"] == "organize"), {})
    hidden, rename = organize.get("excludeByName", {}), organize.get("renameByName", {})
    cols = sorted({k for r in result for k in r["metric"]} - set(hidden) - {"instance", "job", "Hostname"})
    cols = [c for c in ["gpu", "GPU_I_PROFILE", "GPU_I_ID", "UUID"] if c in cols] + [
        c for c in cols if c not in ["gpu", "GPU_I_PROFILE", "GPU_I_ID", "UUID"]
    ]
    rows = [[r["metric"].get(c, "")[:24] for c in cols] + [f"{float(r['value'][1]):.0f}"] for r in result]
    ax.set_xticks([])
    ax.set_yticks([])
    if rows:
        tbl = ax.table(
            cellText=rows, colLabels=[rename.get(c, c) for c in cols] + [rename.get("Value", "Value")], loc="upper center"
        )
        tbl.auto_set_font_size(False)
        tbl.set_fontsize(6)
        for cell in tbl.get_celld().values():
            cell.set_facecolor(PANEL)
            cell.set_edgecolor(GRID)
            cell.get_text().set_color(TEXT)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("recording", nargs="?", default=str(HERE / "recorded/metrics.om.gz"))
    ap.add_argument("--out", default=str(ROOT / "docs/images/dashboard.png"))
    ap.add_argument("--dpi", type=int, default=76)
    args = ap.parse_args()
    dash = json.loads((HERE / "tessera-dashboard.json").read_text())
    with tempfile.TemporaryDirectory(prefix="tessera-picture-") as tmp:
        prom = Prometheus(Path(args.recording), Path(tmp))
        try:
            marks = []
            for a in dash["annotations"]["list"]:
                color = ANNOTATION_COLORS.get(a.get("iconColor"), "#ffffff")
                for r in prom.query(a["expr"]):
                    # One mark where each run of matching steps starts.
                    last = None
                    for ts, _ in r["values"]:
                        if last is None or float(ts) - last > 5:
                            marks.append((when(ts), color))
                        last = float(ts)
            panels = dash["panels"]
            height = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
            fig = plt.figure(figsize=(24 * 0.72, height * 0.3), facecolor=BG)
            unit_w, unit_h = 1 / 24, 1 / height
            for p in panels:
                g = p["gridPos"]
                left, bottom = g["x"] * unit_w, 1 - (g["y"] + g["h"]) * unit_h
                if p["type"] == "row":
                    fig.text(left + 0.004, bottom + unit_h * 0.3, p["title"], color=TEXT, fontsize=11, weight="bold")
                    continue
                pad_x, pad_top, pad_bottom = 0.004, 0.9 * unit_h, 0.7 * unit_h
                if p["type"] == "timeseries":
                    pad_x = 0.035
                if p["type"] == "state-timeline":
                    pad_x = 0.07
                ax = fig.add_axes(
                    [left + pad_x, bottom + pad_bottom, g["w"] * unit_w - pad_x - 0.006, g["h"] * unit_h - pad_top - pad_bottom]
                )
                style(ax, p["title"])
                {"timeseries": lambda: draw_series(ax, p, prom, marks),
                 "stat": lambda: draw_stat(ax, p, prom),
                 "state-timeline": lambda: draw_timeline(ax, p, prom),
                 "table": lambda: draw_table(ax, p, prom)}[p["type"]]()
            fig.text(
                0.995, 0.998,
                "Tessera dashboard (deploy/monitoring/dashboard.py) over series recorded from tesserad on the simulated node "
                "(deploy/monitoring/record.py); dashed lines: annotations (orange breach, red fault, purple XID, green recovery)",
                color="#8e8e8e", fontsize=7, ha="right", va="top",
            )
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(args.out, dpi=args.dpi, facecolor=BG)
        finally:
            prom.close()
    print(f"wrote {args.out} ({Path(args.out).stat().st_size} bytes)")


if __name__ == "__main__":
    main()
