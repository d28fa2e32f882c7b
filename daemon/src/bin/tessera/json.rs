//! The `--json` shapes of the read commands (documented in docs/cli.md; a test parses them).
//! Field names are stable: new fields may be added, none renamed or removed. Enums are their
//! proto value names without the type prefix (`CONVERGED`, `PARTITION_CHANGED`), sizes in bytes,
//! times in nanoseconds.

use serde_json::{Value, json};
use tessera_proto::tessera::v1 as api;

use super::{container_name, describe_layout, enum_name};

/// `tessera events --json`: one object per line (a stream).
pub fn event(e: &api::Event) -> Value {
    json!({
        "sequence": e.sequence,
        "time_unix_nano": e.time_unix_nano,
        "kind": enum_name::<api::EventKind>(e.kind),
        "severity": enum_name::<api::Severity>(e.severity),
        "device_id": e.device_id,
        "device_uuid": e.device_uuid,
        "device_kind": enum_name::<api::DeviceKind>(e.device_kind),
        "affected": e.affected.iter().map(|h| h.allocation_id.as_str()).collect::<Vec<_>>(),
        "message": e.message,
        "detail": e.detail.as_ref().map(detail),
    })
}

/// An event's detail, by its kind (what a script needs without parsing the message).
fn detail(d: &api::event::Detail) -> Value {
    use api::event::Detail;
    match d {
        Detail::LimitBreach(b) => {
            let mut v = json!({
                "allocation_id": b.allocation_id,
                "limit": enum_name::<api::BreachLimit>(b.limit),
                "action": enum_name::<api::BreachAction>(b.action),
                "phase": enum_name::<api::BreachPhase>(b.phase),
                "pids": b.pids,
                "killed_pids": b.killed_pids,
                "gpu_index": b.gpu_index,
            });
            let extra = if b.limit == api::BreachLimit::Sm as i32 {
                json!({"sm_percent_used": b.sm_percent_used, "sm_percent_limit": b.sm_percent_limit, "window_ms": b.window_ms})
            } else {
                json!({"used_bytes": b.used_bytes, "limit_bytes": b.limit_bytes})
            };
            if let (Some(v), Value::Object(extra)) = (v.as_object_mut(), extra) {
                v.extend(extra);
            }
            v
        }
        Detail::AllocationPark(p) => json!({
            "allocation_id": p.allocation_id,
            "bytes": p.bytes,
            "duration_nanos": p.duration_nanos,
            "pids": p.pids,
            "reason": p.reason,
        }),
        Detail::UnattributedProcess(p) => {
            json!({"pid": p.pid, "used_bytes": p.used_bytes, "gpu_index": p.gpu_index, "command": p.command})
        }
        Detail::Fault(f) => json!({
            "kind": enum_name::<api::FaultKind>(f.kind),
            "xid": f.xid,
            "marks_unhealthy": f.marks_unhealthy,
            "health": enum_name::<api::Health>(f.health),
        }),
        Detail::Recovery(r) => json!({
            "from": enum_name::<api::FaultKind>(r.from),
            "xid": r.xid,
            "downtime_nanos": r.downtime_nanos,
            "how": r.how,
        }),
        Detail::HealthChange(h) => json!({
            "previous": enum_name::<api::Health>(h.previous),
            "current": enum_name::<api::Health>(h.current),
            "reason": h.reason,
        }),
        Detail::PartitionChange(p) => json!({
            "previous": p.previous.as_ref().map(describe_layout),
            "current": p.current.as_ref().map(describe_layout),
            "created_device_ids": p.created_device_ids,
            "removed_device_ids": p.removed_device_ids,
        }),
    }
}

/// `tessera layout show --json`.
pub fn partitions(list: &[api::Partition]) -> Value {
    json!({ "gpus": list.iter().map(partition).collect::<Vec<_>>() })
}

fn partition(p: &api::Partition) -> Value {
    json!({
        "gpu_index": p.gpu_index,
        "gpu_uuid": p.gpu_uuid,
        "current": p.current.as_ref().map(describe_layout),
        "desired": p.desired.as_ref().map(describe_layout),
        "state": enum_name::<api::PartitionState>(p.state),
        "mig_mode": enum_name::<api::MigMode>(p.mig_mode),
        "pending_mig_mode": enum_name::<api::MigMode>(p.pending_mig_mode),
        "device_ids": p.device_ids,
        "issues": p.issues.iter().map(issue).collect::<Vec<_>>(),
    })
}

/// A layout issue.
pub fn issue(i: &api::LayoutIssue) -> Value {
    json!({
        "kind": enum_name::<api::LayoutIssueKind>(i.kind),
        "device_id": i.device_id,
        "message": i.message,
        "holders": i.holders.iter().map(|h| h.allocation_id.as_str()).collect::<Vec<_>>(),
    })
}

/// `tessera top --once --json`: one frame.
pub fn usage(u: &api::GetUsageResponse) -> Value {
    json!({
        "time_unix_nano": u.time_unix_nano,
        "window_nanos": u.window_nanos,
        "containers": u.containers.iter().map(|c| json!({
            "allocation_id": c.allocation_id,
            "container": c.container.as_ref().map(container_name).unwrap_or_default(),
            "processes": c.processes,
            "devices": c.devices.iter().map(|d| json!({
                "device_id": d.device_id,
                "uuid": d.uuid,
                "memory_used_bytes": d.memory_used_bytes,
                "memory_peak_bytes": d.memory_peak_bytes,
                "memory_limit_bytes": d.memory_limit_bytes,
                "sm_achieved_percent": super::non_negative(d.sm_achieved_percent),
                "sm_driver_percent": super::non_negative(d.sm_driver_percent),
                "sm_driver_nanos": d.sm_driver_nanos,
                "sm_limit_percent": d.sm_limit_percent,
                "launches": d.launches,
                "launches_per_second": super::non_negative(d.launches_per_second),
                "gpu_time_nanos": d.gpu_time_nanos,
                "throttled_nanos": d.throttled_nanos,
                "oom_denials": d.oom_denials,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

/// `tessera trace --json`: the summary of a recording (the trace itself is in `output`).
pub fn trace(output: &str, allocation_id: &str, r: &api::TraceResponse) -> Value {
    json!({
        "output": output,
        "allocation_id": allocation_id,
        "events": r.events,
        "processes": r.processes,
        "duration_nanos": r.duration_nanos,
        "dropped": r.dropped,
    })
}
