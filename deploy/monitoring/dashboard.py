"""Tessera's Grafana dashboard, as code (grafanalib).

`generate.py` writes it to tessera-dashboard.json; edit this file, never the JSON. Every query
names series tesserad exports (docs/metrics.md); daemon/tests/monitoring.rs checks them against
the exporter's own output.

Rows: the node (GPUs, health, MIG layout, memory used against the limits granted, SM share achieved
against granted), the allocations (per pod: memory used, limit and peak; SM achieved; throttled
time; launches per second; OOM denials) and events (breaches, faults and recoveries, also drawn
as annotations on every panel).
"""

from grafanalib.core import (
    Annotations,
    Dashboard,
    GridPos,
    RowPanel,
    Stat,
    StateTimeline,
    Table,
    Target,
    Template,
    Templating,
    Time,
    TimeSeries,
)

DS = "${datasource}"
NODE = 'instance=~"$instance"'
POD = 'instance=~"$instance",namespace=~"$namespace",pod=~"$pod"'
# The container series name a device by UUID; this joins them to the GPU's index (a MIG device's
# series carry its parent's `gpu`).
TO_GPU = f'on(instance, UUID) group_left(gpu) (DCGM_FI_DEV_FB_FREE{{{NODE}}} * 0 + 1)'
OWNER = "namespace, pod, container, allocation"


def target(expr, legend="", ref="A", instant=False, fmt="time_series"):
    return Target(expr=expr, legendFormat=legend, refId=ref, instant=instant, format=fmt, datasource=DS)


def series(title, targets, pos, unit="short", description="", stacking=None, **kw):
    return TimeSeries(
        title=title,
        description=description,
        dataSource=DS,
        targets=[target(*t[:2], ref=chr(ord("A") + i)) for i, t in enumerate(targets)],
        gridPos=GridPos(*pos),
        unit=unit,
        legendDisplayMode="list",
        legendPlacement="bottom",
        stacking=stacking or {},
        **kw,
    )


def stat(title, expr, pos, description="", unit="none", thresholds=None):
    return Stat(
        title=title,
        description=description,
        dataSource=DS,
        targets=[target(expr, instant=True)],
        gridPos=GridPos(*pos),
        format=unit,
        reduceCalc="lastNotNull",
        graphMode="none",
        colorMode="value",
        thresholds=thresholds
        or [{"color": "green", "value": None}, {"color": "red", "value": 1}],
    )


def healthy_mapping(ok, bad):
    return [
        {
            "type": "value",
            "options": {
                "0": {"text": bad, "color": "red", "index": 0},
                "1": {"text": ok, "color": "green", "index": 1},
            },
        }
    ]


def node_row(y):
    return [
        RowPanel(title="Node", gridPos=GridPos(1, 24, 0, y)),
        stat(
            "GPUs",
            f'count(tessera_gpu_healthy{{{NODE},GPU_I_PROFILE=""}})',
            (4, 4, 0, y + 1),
            "Whole GPUs tesserad manages.",
            thresholds=[{"color": "blue", "value": None}],
        ),
        stat(
            "Unhealthy devices",
            f"count(tessera_gpu_healthy{{{NODE}}} == 0) or vector(0)",
            (4, 4, 4, y + 1),
            "GPUs and MIG devices out of service (tessera events names the fault).",
        ),
        stat(
            "Allocations",
            f"sum(tessera_allocations{{{NODE}}})",
            (4, 4, 8, y + 1),
            thresholds=[{"color": "blue", "value": None}],
        ),
        stat(
            "Unattributed GPU processes",
            f"sum(tessera_unattributed_gpu_processes{{{NODE}}})",
            (4, 4, 12, y + 1),
            "Processes holding GPU memory outside any allocation: no limit holds them.",
        ),
        stat(
            "Layouts not converged",
            f"count(tessera_gpu_layout_converged{{{NODE}}} == 0) or vector(0)",
            (4, 4, 16, y + 1),
            "Managed GPUs whose configured layout (MIG devices, shares) is not in place.",
        ),
        stat(
            "Limit breaches",
            f"sum(tessera_container_limit_breaches_total{{{NODE}}}) or vector(0)",
            (4, 4, 20, y + 1),
            "Breaches of memory or strict SM limits by the driver's figures since tesserad started "
            "(an allocation's first breach makes its series: increase() would miss it).",
        ),
        StateTimeline(
            title="GPU and MIG device health",
            description="1: in service; 0: taken out by a fault (XID, ECC, lost).",
            dataSource=DS,
            targets=[
                target(
                    f"tessera_gpu_healthy{{{NODE}}}",
                    "{{Hostname}} GPU {{gpu}} {{GPU_I_PROFILE}}",
                )
            ],
            gridPos=GridPos(8, 12, 0, y + 5),
            mappings=healthy_mapping("healthy", "unhealthy"),
            showValue="never",
            mergeValues=True,
        ),
        StateTimeline(
            title="Layout converged",
            description="Per managed GPU: the configured MIG layout or shares in place (1) or not (0).",
            dataSource=DS,
            targets=[target(f"tessera_gpu_layout_converged{{{NODE}}}", "{{Hostname}} GPU {{gpu}}")],
            gridPos=GridPos(8, 12, 12, y + 5),
            mappings=healthy_mapping("converged", "not converged"),
            showValue="never",
            mergeValues=True,
        ),
        Table(
            title="MIG devices",
            description="The MIG devices in place: profile, instance id, memory.",
            dataSource=DS,
            targets=[
                target(
                    f'DCGM_FI_DEV_FB_USED{{{NODE},GPU_I_PROFILE!=""}} + DCGM_FI_DEV_FB_FREE{{{NODE},GPU_I_PROFILE!=""}}',
                    instant=True,
                    fmt="table",
                )
            ],
            gridPos=GridPos(7, 8, 0, y + 13),
            transformations=[
                {
                    "id": "organize",
                    "options": {
                        "excludeByName": {"Time": True, "device": True, "modelName": True, "pci_bus_id": True},
                        "renameByName": {"Value": "memory (MiB)", "GPU_I_PROFILE": "profile", "GPU_I_ID": "instance"},
                    },
                }
            ],
        ),
        series(
            "Memory used against limits granted, per GPU",
            [
                (f'sum by (gpu) (DCGM_FI_DEV_FB_USED{{{NODE},GPU_I_PROFILE=""}}) * 1048576', "GPU {{gpu}} used"),
                (f"sum by (gpu) (tessera_container_memory_limit_bytes{{{NODE}}} * {TO_GPU})", "GPU {{gpu}} limits"),
            ],
            (7, 8, 8, y + 13),
            unit="bytes",
            description="Device memory used (NVML, every process) and the sum of the memory limits of the allocations on the GPU.",
        ),
        series(
            "SM share achieved against granted, per GPU",
            [
                (f"sum by (gpu) (tessera_container_sm_achieved_percent{{{NODE}}} * {TO_GPU})", "GPU {{gpu}} achieved"),
                (f"sum by (gpu) (tessera_container_sm_limit_percent{{{NODE}}} * {TO_GPU})", "GPU {{gpu}} granted"),
            ],
            (7, 8, 16, y + 13),
            unit="percent",
            description="GPU time the containers got over wall time, against the SM shares they were granted.",
        ),
    ]


def allocation_row(y):
    legend = "{{namespace}}/{{pod}} {{allocation}}"
    by = f"sum by ({OWNER})"
    return [
        RowPanel(title="Allocations", gridPos=GridPos(1, 24, 0, y)),
        series(
            "Memory used, limit and peak",
            [
                (f"{by} (tessera_container_memory_used_bytes{{{POD}}})", legend + " used"),
                (f"{by} (tessera_container_memory_limit_bytes{{{POD}}})", legend + " limit"),
                (f"{by} (tessera_container_memory_peak_bytes{{{POD}}})", legend + " peak"),
            ],
            (8, 12, 0, y + 1),
            unit="bytes",
            description="Per container: device memory held now, its limit, and the most it has held.",
        ),
        series(
            "SM achieved against its share",
            [
                (f"{by} (tessera_container_sm_achieved_percent{{{POD}}})", legend + " achieved"),
                (f"{by} (tessera_container_sm_limit_percent{{{POD}}})", legend + " share"),
            ],
            (8, 12, 12, y + 1),
            unit="percent",
            description="GPU time over wall time, against the SM share (absent: no limit).",
        ),
        series(
            "Throttled time",
            [(f"{by} (rate(tessera_container_throttled_seconds_total{{{POD}}}[$__rate_interval]))", legend)],
            (8, 8, 0, y + 9),
            unit="percentunit",
            description="Share of wall time the container's launches were held back by its SM share.",
        ),
        series(
            "Launches per second",
            [(f"{by} (rate(tessera_container_launches_total{{{POD}}}[$__rate_interval]))", legend)],
            (8, 8, 8, y + 9),
            unit="ops",
        ),
        series(
            "OOM denials",
            [(f"{by} (increase(tessera_container_oom_denials_total{{{POD}}}[$__rate_interval]))", legend)],
            (8, 8, 16, y + 9),
            unit="short",
            description="Allocations refused by the memory limit (CUDA_ERROR_OUT_OF_MEMORY).",
        ),
    ]


def events_row(y):
    return [
        RowPanel(title="Events", gridPos=GridPos(1, 24, 0, y)),
        series(
            "Limit breaches (since tesserad started)",
            [
                (
                    f"sum by ({OWNER}, limit, action) (tessera_container_limit_breaches_total{{{POD}}})",
                    "{{namespace}}/{{pod}} {{allocation}} {{limit}} ({{action}})",
                )
            ],
            (7, 12, 0, y + 1),
            description="limit_breach events: memory over the limit or SM time over a strict share, by the driver's figures.",
        ),
        series(
            "Faults and events",
            [
                (f"sum(increase(tessera_faults_total{{{NODE}}}[$__rate_interval]))", "faults"),
                (f"sum(increase(tessera_events_total{{{NODE}}}[$__rate_interval]))", "all events"),
                (f"sum(tessera_unattributed_gpu_processes{{{NODE}}})", "unattributed processes"),
            ],
            (7, 12, 12, y + 1),
            description="Events tesserad published (faults among them), and processes outside any allocation.",
        ),
    ]


def annotation(name, expr, color, title, text):
    return {
        "name": name,
        "datasource": DS,
        "enable": True,
        "iconColor": color,
        "expr": expr,
        "step": "60s",
        "titleFormat": title,
        "textFormat": text,
        "tagKeys": "Hostname,instance",
        "useValueForTime": False,
    }


ANNOTATIONS = [
    annotation(
        "Limit breaches",
        # A new series (an allocation's first breach) or a counter that moved in the last minute.
        f"sum by ({OWNER}, limit, action) ((changes(tessera_container_limit_breaches_total{{{NODE}}}[1m]) > 0)"
        f" or (tessera_container_limit_breaches_total{{{NODE}}} unless tessera_container_limit_breaches_total{{{NODE}}} offset 1m))",
        "orange",
        "{{limit}} limit breach ({{action}})",
        "{{namespace}}/{{pod}} allocation {{allocation}}",
    ),
    annotation(
        "GPU faults",
        f"(tessera_gpu_healthy{{{NODE}}} == 0) and (changes(tessera_gpu_healthy{{{NODE}}}[1m]) > 0)",
        "red",
        "GPU {{gpu}} {{GPU_I_PROFILE}} unhealthy",
        "{{Hostname}} {{UUID}}",
    ),
    annotation(
        "XIDs",
        f"(DCGM_FI_DEV_XID_ERRORS{{{NODE}}} != 0) and (changes(DCGM_FI_DEV_XID_ERRORS{{{NODE}}}[1m]) > 0)",
        "purple",
        "XID on GPU {{gpu}}",
        "{{Hostname}} {{UUID}}",
    ),
    annotation(
        "GPU recoveries",
        f"(tessera_gpu_healthy{{{NODE}}} == 1) and (changes(tessera_gpu_healthy{{{NODE}}}[1m]) > 0)",
        "green",
        "GPU {{gpu}} {{GPU_I_PROFILE}} back in service",
        "{{Hostname}} {{UUID}}",
    ),
]


def variable(name, label, query):
    return Template(
        name=name,
        label=label,
        query=query,
        dataSource=DS,
        type="query",
        includeAll=True,
        multi=True,
        allValue=".*",
        refresh=2,
        sort=1,
    )


dashboard = Dashboard(
    title="Tessera",
    uid="tessera",
    description="GPUs, allocations and events of Tessera's node daemons (tesserad).",
    tags=["tessera", "gpu"],
    timezone="browser",
    time=Time("now-1h", "now"),
    refresh="30s",
    annotations=Annotations(list=ANNOTATIONS),
    templating=Templating(
        list=[
            Template(name="datasource", label="Data source", query="prometheus", type="datasource"),
            variable("instance", "Node", "label_values(tessera_allocations, instance)"),
            variable(
                "namespace",
                "Namespace",
                'label_values(tessera_container_memory_used_bytes{instance=~"$instance"}, namespace)',
            ),
            variable(
                "pod",
                "Pod",
                'label_values(tessera_container_memory_used_bytes{instance=~"$instance",namespace=~"$namespace"}, pod)',
            ),
        ]
    ),
    panels=node_row(0) + allocation_row(21) + events_row(38),
).auto_panel_ids()
