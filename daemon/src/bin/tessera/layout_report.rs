//! How `layout apply` and `reload` print per-GPU layout results: one line per GPU, its issues
//! indented under it. A dry run prints the same text as the real run, with `(dry run)` after the
//! outcome, so the two can be compared.

use tessera_proto::tessera::v1 as api;

use super::{describe_layout, enum_name};

/// The results as text, one GPU per line (GPUs that do not exist: what the node has).
pub fn results(results: &[api::GpuLayoutResult], dry_run: bool) -> String {
    let mut out = String::new();
    for r in results {
        if r.gpu_uuid.is_empty() {
            // Not found: the issue says which GPUs exist.
            for i in &r.issues {
                let message = i.message.split_once("]: ").map_or(i.message.as_str(), |(_, m)| m);
                let dry = if dry_run { " (dry run)" } else { "" };
                out.push_str(&format!("GPU {}: refused{dry}: {message}\n", r.gpu_id));
            }
            continue;
        }
        out.push_str(&format!(
            "GPU {} {}: {}{} -> {} (+{} -{} devices)\n",
            r.gpu_index,
            r.gpu_uuid,
            enum_name::<api::LayoutOutcome>(r.outcome).to_lowercase(),
            if dry_run { " (dry run)" } else { "" },
            r.layout.as_ref().map(describe_layout).unwrap_or_else(|| "-".into()),
            r.created_device_ids.len(),
            r.removed_device_ids.len()
        ));
        for i in &r.issues {
            let held: Vec<&str> = i.holders.iter().map(|h| h.allocation_id.as_str()).collect();
            let by = if held.is_empty() { String::new() } else { format!(" [held by {}]", held.join(", ")) };
            out.push_str(&format!(
                "  {}: {}{by}\n",
                enum_name::<api::LayoutIssueKind>(i.kind).to_lowercase(),
                i.message
            ));
        }
    }
    out
}
