//! Telemetry export: Prometheus `/metrics` (off unless `telemetry.metrics_listen` is set: a TCP
//! address, or `unix:PATH` for an owner-only Unix socket only root can scrape).
//!
//! - [`prometheus`]: the node's metrics ([`NodeMetrics`]: GPUs, per-container usage from
//!   [`crate::usage`], counts) in the Prometheus text format, with dcgm-exporter's names and
//!   labels for the per-GPU series so existing dashboards keep working.
//! - [`server`]: the HTTP endpoint ([`listen`] then [`serve_on`]) over a [`MetricsSource`].
//! - [`source`]: the daemon's source ([`NodeSource`]): NVML, the controller, the regions.

pub mod otlp;
pub mod prometheus;
pub mod server;
pub mod source;

pub use otlp::{OtlpExporter, OtlpOptions};
pub use prometheus::{GpuMetrics, GpuSensors, NodeMetrics, render};
pub use server::{MetricsListener, MetricsSource, bind, listen, serve, serve_on};
pub use source::NodeSource;

/// What can go wrong setting up telemetry; names the configuration key.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("{key}: {addr:?}: {reason}")]
    Listen { key: &'static str, addr: String, reason: String },
}
