"""Checks the alert rules, their promtool tests and the dashboard against what tesserad exports.

    python deploy/monitoring/check.py SCRAPE

SCRAPE is tesserad's /metrics text (daemon/tests/monitoring.rs renders one with every family the
exporter writes). It checks that:

- every series a rule, a dashboard panel, an annotation or a variable queries is one SCRAPE has
  (or `up`, which Prometheus makes), and every label they name is one those series carry;
- every input series of tessera-rules.test.yaml is labelled as SCRAPE labels that series (plus
  Prometheus's `instance` and `job`);
- every alert has a test case where it fires and one where it stays quiet;
- the PrometheusRule holds exactly the rules of tessera-rules.yaml.

It prints each problem and exits 1 if there is one.
"""

import json
import re
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
# Series Prometheus makes itself, with their labels.
PROMETHEUS_SERIES = {"up": {"instance", "job"}}
TARGET_LABELS = {"instance", "job"}
KEYWORDS = {"and", "or", "unless", "offset", "bool", "by", "without", "on", "ignoring", "group_left", "group_right"}
LABEL_RE = r"[a-zA-Z_][a-zA-Z0-9_]*"


def parse_scrape(text):
    """{name: (labels every sample has, labels some sample has)} of the exposition text."""
    names = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.setdefault(line.split()[2], None)
            continue
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? \S+$", line)
        if not m:
            raise SystemExit(f"unreadable scrape line: {line!r}")
        keys = set(re.findall(r'(' + LABEL_RE + r')="(?:[^"\\]|\\.)*"', m.group(2) or ""))
        common, some = names.get(m.group(1)) or (None, set())
        names[m.group(1)] = (keys if common is None else common & keys, some | keys)
    return {n: v or (set(), set()) for n, v in names.items()}


def selectors(expr):
    """(metric names, label names) a PromQL expression (with Grafana's $variables) names."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values, Grafana variables in them
    labels = set()
    for block in re.findall(r"\{([^}]*)\}", e):
        labels |= set(re.findall(r"(" + LABEL_RE + r")\s*(?:=~|!~|!=|=)", block))
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)  # ranges, $__rate_interval
    e = re.sub(r"\boffset\s+\w+", " ", e)
    for group in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", e):
        labels |= {x.strip() for x in group.split(",") if x.strip()}
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w$.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(\s*\()?", e):
        word, call = m.group(1), m.group(2)
        if call or word in KEYWORDS:
            continue
        names.add(word)
    return names, labels


def dashboard_queries(dash):
    """Every PromQL expression of the dashboard: panels, annotations, variables."""
    out = []

    def panels(ps):
        for p in ps:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((f"panel {p.get('title')!r}", t["expr"]))
            panels(p.get("panels", []))

    panels(dash.get("panels", []))
    for a in dash.get("annotations", {}).get("list", []):
        if a.get("expr"):
            out.append((f"annotation {a.get('name')!r}", a["expr"]))
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        if v.get("type") == "query" and isinstance(q, str):
            m = re.fullmatch(r"label_values\((.*),\s*(" + LABEL_RE + r")\)", q)
            if not m:
                raise SystemExit(f"variable {v['name']}: not label_values(SERIES, LABEL): {q}")
            out.append((f"variable {v['name']!r}", m.group(1)))
            out.append((f"variable {v['name']!r} (label)", f"x{{{m.group(2)}=\"\"}}"))
    return out


def parse_series(s):
    m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\}", s.strip())
    if not m:
        return s.strip(), set()
    return m.group(1), set(re.findall(r"(" + LABEL_RE + r')="(?:[^"\\]|\\.)*"', m.group(2)))


def main():
    scrape = parse_scrape(Path(sys.argv[1]).read_text())
    exported = dict(scrape)
    for n, keys in PROMETHEUS_SERIES.items():
        exported[n] = (keys, keys)
    all_labels = set().union(*(some for _, some in exported.values())) | TARGET_LABELS
    problems = []

    rules = yaml.safe_load((HERE / "tessera-rules.yaml").read_text())
    queries = [(f"rule {r['alert']}", r["expr"]) for g in rules["groups"] for r in g["rules"]]
    dash = json.loads((HERE / "tessera-dashboard.json").read_text())
    queries += [(where, q.replace("x{", "up{", 1) if where.endswith("(label)") else q) for where, q in dashboard_queries(dash)]
    checked = set()
    for where, q in queries:
        names, labels = selectors(q)
        if not names:
            problems.append(f"{where}: names no series: {q}")
        for n in sorted(names - set(exported)):
            problems.append(f"{where}: {n} is not a series tesserad exports: {q}")
        for label in sorted(labels - all_labels):
            problems.append(f"{where}: label {label} is on no series tesserad exports: {q}")
        checked |= names

    tests = yaml.safe_load((HERE / "tessera-rules.test.yaml").read_text())
    cases = {}
    for group in tests["tests"]:
        for s in group.get("input_series", []):
            name, keys = parse_series(s["series"])
            if name not in exported:
                problems.append(f"test series {name}: not a series tesserad exports")
                continue
            common, some = exported[name]
            keys -= TARGET_LABELS
            common, some = common - TARGET_LABELS, some - TARGET_LABELS
            if not common <= keys or not keys <= some:
                problems.append(
                    f"test series {name}: labels {sorted(keys)}, tesserad's have {sorted(common)}"
                    + (f" and maybe {sorted(some - common)}" if some != common else "")
                )
        for case in group.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], []).append(bool(case.get("exp_alerts")))
    for g in rules["groups"]:
        for r in g["rules"]:
            got = cases.get(r["alert"], [])
            if True not in got:
                problems.append(f"rule {r['alert']}: no test case where it fires")
            if False not in got:
                problems.append(f"rule {r['alert']}: no test case where it stays quiet")

    rule_crd = yaml.safe_load((ROOT / "deploy/kubernetes/monitoring/prometheusrule.yaml").read_text())
    if rule_crd.get("kind") != "PrometheusRule" or rule_crd["spec"] != rules:
        problems.append("deploy/kubernetes/monitoring/prometheusrule.yaml: not the rules of tessera-rules.yaml")

    for p in problems:
        print(p, file=sys.stderr)
    print(f"{len(queries)} queries naming {len(checked)} series, {len(cases)} alerts tested, {len(problems)} problems")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
