//! `tessera top`: a live view of the node's GPUs and containers, from the node API's devices
//! and usage.

use std::process::ExitCode;

use tessera_proto::tessera::v1 as api;
use tessera_proto::tessera::v1::node_client::NodeClient;
use tonic::transport::Channel;

use crate::{container_name, health, json, mib, non_negative, output, percent, row, status_err, table, time};

/// `tessera top`: frames of GPU and container usage; rates over the refresh interval (the
/// node API's usage window).
pub(crate) async fn run(
    client: &mut NodeClient<Channel>,
    interval_ms: u64,
    once: bool,
    as_json: bool,
) -> Result<ExitCode, String> {
    let interval = std::time::Duration::from_millis(interval_ms);
    // The first sample opens the rate window.
    client.get_usage(api::GetUsageRequest::default()).await.map_err(status_err)?;
    loop {
        tokio::time::sleep(interval).await;
        let devices =
            client.list_devices(api::ListDevicesRequest::default()).await.map_err(status_err)?.into_inner().devices;
        let usage = client.get_usage(api::GetUsageRequest::default()).await.map_err(status_err)?.into_inner();
        if as_json {
            println!("{}", json::usage(&usage));
        } else if once || !output::is_terminal() {
            // Piped or logged: frames one after another, no screen control.
            let frame = top_frame(&devices, &usage);
            print!("{}{frame}", if once { "" } else { "\n" });
        } else {
            // Clear the screen, then draw.
            print!("\x1b[H\x1b[2J{}", top_frame(&devices, &usage));
        }
        if once {
            return Ok(ExitCode::SUCCESS);
        }
    }
}

fn top_frame(devices: &[api::Device], usage: &api::GetUsageResponse) -> String {
    let mut out = format!(
        "tessera top  {}  window {:.1} s  {} containers\n\n",
        time(usage.time_unix_nano),
        usage.window_nanos as f64 / 1e9,
        usage.containers.len()
    );
    let mut gpu_rows = vec![row(["GPU", "MODEL", "HEALTH", "CONTAINERS", "MEM USED", "SM USED"])];
    for g in devices.iter().filter(|d| d.kind == api::DeviceKind::Gpu as i32) {
        // Containers on this GPU: their devices' UUID is the GPU's or one of its MIG devices'.
        let on_gpu = |uuid: &str| uuid == g.uuid || devices.iter().any(|d| d.uuid == uuid && d.parent_id == g.id);
        let rows: Vec<&api::DeviceUsage> =
            usage.containers.iter().flat_map(|c| &c.devices).filter(|d| on_gpu(&d.uuid)).collect();
        let containers = usage.containers.iter().filter(|c| c.devices.iter().any(|d| on_gpu(&d.uuid))).count();
        gpu_rows.push(row([
            g.index.to_string(),
            g.model.clone(),
            health(g),
            containers.to_string(),
            format!("{} / {}", mib(rows.iter().map(|d| d.memory_used_bytes).sum()), mib(g.memory_bytes)),
            percent(rows.iter().map(|d| d.sm_achieved_percent).sum::<f64>()),
        ]));
    }
    let mut rows = vec![row([
        "ALLOCATION",
        "CONTAINER",
        "DEVICE",
        "PROCS",
        "MEM USED / LIMIT",
        "PEAK",
        "SM NOW / LIMIT",
        "SM DRIVER",
        "LAUNCH/S",
        "THROTTLED",
        "OOM",
    ])];
    let mut lines: Vec<(&api::ContainerUsage, &api::DeviceUsage)> =
        usage.containers.iter().flat_map(|c| c.devices.iter().map(move |d| (c, d))).collect();
    lines.sort_by(|a, b| b.1.sm_achieved_percent.total_cmp(&a.1.sm_achieved_percent));
    for (c, d) in lines {
        let limit = |v: u64, f: fn(u64) -> String| if v == 0 { "-".to_owned() } else { f(v) };
        rows.push(row([
            c.allocation_id.clone(),
            c.container.as_ref().map(container_name).filter(|n| !n.is_empty()).unwrap_or_else(|| "-".into()),
            d.device_id.clone(),
            c.processes.to_string(),
            format!("{} / {}", mib(d.memory_used_bytes), limit(d.memory_limit_bytes, mib)),
            mib(d.memory_peak_bytes),
            format!(
                "{} / {}",
                percent(d.sm_achieved_percent),
                limit(u64::from(d.sm_limit_percent), |p| format!("{p}%"))
            ),
            // The driver's figure: what the container's own counters cannot fake.
            if d.uuid.starts_with("MIG-") { "-".to_owned() } else { percent(d.sm_driver_percent) },
            format!("{:.0}", non_negative(d.launches_per_second)),
            format!("{:.2} s", d.throttled_nanos as f64 / 1e9),
            d.oom_denials.to_string(),
        ]));
    }
    out.push_str(&table(&gpu_rows));
    out.push('\n');
    out.push_str(&table(&rows));
    out
}
