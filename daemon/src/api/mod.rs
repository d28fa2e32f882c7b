//! The node API, `tessera.v1.Node`, served on an owner-only Unix socket (nothing listens on a
//! network address). Reports come from the controller's live picture; `ApplyLayout` and `Reload`
//! go through the controller; `WatchEvents` streams the event bus; `Trace` records a container
//! for a few seconds (`crate::trace`); `Allocate`, `Release` and `SetLimits` carve, give back
//! and change shares without a kubelet (`alloc`).

mod alloc;
mod devices;

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use tessera_proto::tessera::v1 as api;
use tessera_proto::tessera::v1::node_server::{Node, NodeServer};
use tokio::sync::{broadcast, mpsc, watch};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::node::NodeController;
use crate::usage::UsageSampler;

pub use devices::{list_devices, list_partitions};

/// The service.
#[derive(Debug)]
pub struct NodeApi {
    controller: Arc<NodeController>,
    usage: Mutex<Usage>,
    /// The enforcement loop's counters: SM time by the driver.
    enforcement: Option<Arc<crate::enforcement::Stats>>,
    /// Ends open event streams when the daemon stops (a graceful stop waits for open calls).
    shutdown: watch::Receiver<bool>,
}

/// `GetUsage`'s state between calls: the regions' sampler, and each allocation and device's SM
/// time by the driver at the last call (ns, as of), for its rate.
#[derive(Debug, Default)]
struct Usage {
    sampler: UsageSampler,
    driver_sm: std::collections::HashMap<(String, String), (u64, u64)>,
}

impl NodeApi {
    pub fn new(
        controller: Arc<NodeController>,
        enforcement: Option<Arc<crate::enforcement::Stats>>,
        shutdown: watch::Receiver<bool>,
    ) -> NodeApi {
        NodeApi { controller, usage: Mutex::new(Usage::default()), enforcement, shutdown }
    }
}

/// Serves the node API on `socket` (mode 0600) until `shutdown` turns true; the socket is removed
/// at the end.
pub async fn serve(
    socket: PathBuf,
    controller: Arc<NodeController>,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let listener = bind(&socket)?;
    serve_on(listener, socket, controller, None, shutdown).await
}

/// An error when a running process answers on `socket`: another daemon's (the same
/// runtime_dir). Replaced, it lost its node API, and then its socket when this one stopped; only
/// a stale socket is replaced. tesserad asks before it touches anything under its runtime_dir
/// (a second daemon removed the first one's spare allocation directories, then exited here).
pub fn refuse_if_served(socket: &std::path::Path) -> std::io::Result<()> {
    if std::os::unix::net::UnixStream::connect(socket).is_ok() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::AddrInUse,
            format!(
                "{}: a running process serves it (another tesserad with the same runtime_dir?); stop it, or give \
                 this daemon another runtime_dir or node_api_socket",
                socket.display()
            ),
        ));
    }
    Ok(())
}

/// Binds the node API's socket (owner-only), making its directory if needed: once this returns,
/// clients can connect.
pub fn bind(socket: &std::path::Path) -> std::io::Result<tokio::net::UnixListener> {
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir)?;
    }
    refuse_if_served(socket)?;
    let listener = crate::socket::bind_owner_only_tokio(socket)?;
    tracing::info!(socket = %socket.display(), "node API listening");
    Ok(listener)
}

/// [`serve`] on a socket [`bind`] made, with the enforcement loop's counters when it runs;
/// removes `socket` when it stops.
pub async fn serve_on(
    listener: tokio::net::UnixListener,
    socket: PathBuf,
    controller: Arc<NodeController>,
    enforcement: Option<Arc<crate::enforcement::Stats>>,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    // Kept bound if removed; its identity, so that only ours is removed at the end.
    let (incoming, ours) = crate::socket::Incoming::new(listener, "node API").keeping(&socket);
    let result = tonic::transport::Server::builder()
        .add_service(NodeServer::new(NodeApi::new(controller, enforcement, shutdown.clone())))
        .serve_with_incoming_shutdown(incoming, async move {
            let _ = shutdown.wait_for(|s| *s).await;
        })
        .await;
    let ours = *ours.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if ours.is_some() && crate::socket::identity(&socket) == ours {
        let _ = std::fs::remove_file(&socket);
    }
    result.map_err(std::io::Error::other)
}

type EventStream = Pin<Box<dyn Stream<Item = Result<api::Event, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl Node for NodeApi {
    async fn list_devices(
        &self,
        req: Request<api::ListDevicesRequest>,
    ) -> Result<Response<api::ListDevicesResponse>, Status> {
        let req = req.into_inner();
        let view = self.controller.view();
        let offer = self.controller.kubelet_offer().unwrap_or_default();
        let devices = list_devices(&view, &self.controller.allocations(), &offer.withdrawn, &req)?;
        Ok(Response::new(api::ListDevicesResponse { devices }))
    }

    async fn list_partitions(
        &self,
        req: Request<api::ListPartitionsRequest>,
    ) -> Result<Response<api::ListPartitionsResponse>, Status> {
        let view = self.controller.view();
        let partitions = list_partitions(&view, &req.into_inner().gpu)?;
        Ok(Response::new(api::ListPartitionsResponse { partitions }))
    }

    async fn list_allocations(
        &self,
        req: Request<api::ListAllocationsRequest>,
    ) -> Result<Response<api::ListAllocationsResponse>, Status> {
        let req = req.into_inner();
        let resources = self.controller.allocator().resources();
        let allocations = self
            .controller
            .allocations()
            .into_iter()
            .filter(|a| {
                req.device_id.is_empty()
                    || a.devices.iter().any(|d| d.device_id == req.device_id || d.physical_uuid == req.device_id)
            })
            .filter(|a| {
                req.pod_namespace.is_empty() || a.container.pod_namespace.as_deref() == Some(&req.pod_namespace)
            })
            .filter(|a| req.pod_name.is_empty() || a.container.pod_name.as_deref() == Some(&req.pod_name))
            .map(|a| {
                let mut shown = devices::allocation(&a, &resources);
                shown.state = alloc::state(self.controller.allocator().park_state(&a.id)) as i32;
                shown.preempted_by = self.controller.allocator().preempted_by(&a.id).unwrap_or_default();
                shown
            })
            .collect();
        Ok(Response::new(api::ListAllocationsResponse { allocations }))
    }

    async fn apply_layout(
        &self,
        req: Request<api::ApplyLayoutRequest>,
    ) -> Result<Response<api::ApplyLayoutResponse>, Status> {
        let controller = Arc::clone(&self.controller);
        let req = req.into_inner();
        // NVML calls and state on disk: off the async workers.
        let result = tokio::task::spawn_blocking(move || controller.apply_layout(&req))
            .await
            .map_err(|e| Status::internal(format!("layout task: {e}")))?;
        result.map(Response::new).map_err(Status::invalid_argument)
    }

    type WatchEventsStream = EventStream;

    async fn watch_events(
        &self,
        req: Request<api::WatchEventsRequest>,
    ) -> Result<Response<Self::WatchEventsStream>, Status> {
        let req = req.into_inner();
        for (i, k) in req.kinds.iter().enumerate() {
            if api::EventKind::try_from(*k).is_err() {
                return Err(Status::invalid_argument(format!("kinds[{i}]: {k} is not an EventKind")));
            }
        }
        let (past, mut rx) = self.controller.events().subscribe(req.replay as usize);
        let wanted = move |e: &api::Event| {
            (req.kinds.is_empty() || req.kinds.contains(&e.kind))
                && (req.device_id.is_empty() || e.device_id == req.device_id || e.device_uuid == req.device_id)
        };
        let (tx, out) = mpsc::channel(64);
        let mut shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            for e in past.into_iter().filter(&wanted) {
                if tx.send(Ok(e)).await.is_err() {
                    return;
                }
            }
            loop {
                let e = tokio::select! {
                    r = rx.recv() => r,
                    () = tx.closed() => return,
                    _ = shutdown.wait_for(|s| *s) => return,
                };
                match e {
                    Ok(e) if wanted(&e) => {
                        if tx.send(Ok(e)).await.is_err() {
                            return;
                        }
                    }
                    Ok(_) => {}
                    // The subscriber sees the gap in the sequence numbers.
                    Err(broadcast::error::RecvError::Lagged(n)) => tracing::warn!(missed = n, "event watcher lagged"),
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out))))
    }

    async fn get_usage(&self, req: Request<api::GetUsageRequest>) -> Result<Response<api::GetUsageResponse>, Status> {
        let req = req.into_inner();
        let allocations = self.controller.allocations();
        if !req.allocation_id.is_empty() && !allocations.iter().any(|a| a.id == req.allocation_id) {
            return Err(Status::not_found(format!("allocation_id: no allocation {:?}", req.allocation_id)));
        }
        let mut usage = self.usage.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let report =
            usage.sampler.sample(&allocations, self.controller.allocator().dirs(), tessera_region::monotonic_ns());
        let mut resp = devices::usage_response(&report, &allocations, &req);
        if let Some(stats) = &self.enforcement {
            let sm_time = stats.metrics().sm_time;
            usage.driver_sm.retain(|(id, _), _| allocations.iter().any(|a| &a.id == id));
            for c in &mut resp.containers {
                for d in &mut c.devices {
                    let Some(t) = sm_time
                        .iter()
                        .find(|t| t.on.allocation == c.allocation_id && t.on.uuid.eq_ignore_ascii_case(&d.uuid))
                    else {
                        continue;
                    };
                    d.sm_driver_nanos = t.ns;
                    let key = (c.allocation_id.clone(), t.on.uuid.clone());
                    if let Some(&(ns, as_of)) = usage.driver_sm.get(&key)
                        && t.as_of_ns > as_of
                    {
                        d.sm_driver_percent = t.ns.saturating_sub(ns) as f64 / (t.as_of_ns - as_of) as f64 * 100.0;
                    }
                    usage.driver_sm.insert(key, (t.ns, t.as_of_ns));
                }
            }
        }
        Ok(Response::new(resp))
    }

    async fn reload(&self, req: Request<api::ReloadRequest>) -> Result<Response<api::ReloadResponse>, Status> {
        let controller = Arc::clone(&self.controller);
        let dry_run = req.into_inner().dry_run;
        tokio::task::spawn_blocking(move || controller.reload(dry_run))
            .await
            .map(Response::new)
            .map_err(|e| Status::internal(format!("reload task: {e}")))
    }

    async fn trace(&self, req: Request<api::TraceRequest>) -> Result<Response<api::TraceResponse>, Status> {
        let req = req.into_inner();
        if req.allocation_id.is_empty() {
            return Err(Status::invalid_argument("allocation_id: required"));
        }
        let duration = crate::trace::check_seconds(req.seconds).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let Some(alloc) = self.controller.allocations().into_iter().find(|a| a.id == req.allocation_id) else {
            return Err(Status::not_found(format!("allocation_id: no allocation {:?}", req.allocation_id)));
        };
        let path = self.controller.allocator().dirs().region_path(&alloc.id);
        let mut shutdown = self.shutdown.clone();
        let collected = tokio::select! {
            r = crate::trace::collect(&alloc.id, &path, duration) => r,
            _ = shutdown.wait_for(|s| *s) => return Err(Status::unavailable("the daemon is stopping")),
        };
        let collected = collected.map_err(|e| match e {
            crate::trace::TraceError::Seconds(_) => Status::invalid_argument(e.to_string()),
            crate::trace::TraceError::Busy(_) => Status::failed_precondition(e.to_string()),
            crate::trace::TraceError::Region(_) => Status::failed_precondition(e.to_string()),
        })?;
        let container = devices::allocation(&alloc, &self.controller.allocator().resources())
            .container
            .map(|c| {
                [c.pod_namespace, c.pod_name, c.container_name]
                    .into_iter()
                    .filter(|s| !s.is_empty())
                    .collect::<Vec<_>>()
                    .join("/")
            })
            .unwrap_or_default();
        let doc = crate::trace::render(&collected, &alloc.id, &container);
        let processes = collected.entries.iter().map(|e| e.pid).collect::<std::collections::BTreeSet<_>>().len();
        Ok(Response::new(api::TraceResponse {
            trace_json: serde_json::to_vec(&doc).map_err(|e| Status::internal(format!("trace JSON: {e}")))?,
            events: collected.entries.len() as u64,
            dropped: collected.dropped,
            processes: processes as u32,
            duration_nanos: collected.end_ns.saturating_sub(collected.start_ns),
        }))
    }

    async fn allocate(&self, req: Request<api::AllocateRequest>) -> Result<Response<api::AllocateResponse>, Status> {
        // A journal flush and a directory made, on this handler's thread (`blocking`).
        crate::blocking::run(|| alloc::allocate(&self.controller, &req.into_inner())).map(Response::new)
    }

    async fn release(&self, req: Request<api::ReleaseRequest>) -> Result<Response<api::ReleaseResponse>, Status> {
        crate::blocking::run(|| alloc::release(&self.controller, &req.into_inner())).map(Response::new)
    }

    async fn set_limits(
        &self,
        req: Request<api::SetLimitsRequest>,
    ) -> Result<Response<api::SetLimitsResponse>, Status> {
        crate::blocking::run(|| alloc::set_limits(&self.controller, &req.into_inner())).map(Response::new)
    }

    async fn park(&self, req: Request<api::ParkRequest>) -> Result<Response<api::ParkResponse>, Status> {
        // Locks wait for the processes' GPU work, and memory is copied: off the async threads.
        crate::blocking::run(|| alloc::park(&self.controller, &req.into_inner())).map(Response::new)
    }

    async fn resume(&self, req: Request<api::ResumeRequest>) -> Result<Response<api::ResumeResponse>, Status> {
        crate::blocking::run(|| alloc::resume(&self.controller, &req.into_inner())).map(Response::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Another daemon's live socket is never taken over (it lost its node API, and its socket when
    /// the second one stopped); a stale one is replaced.
    #[tokio::test]
    async fn a_live_node_api_socket_is_refused_and_a_stale_one_replaced() {
        let tmp = tempfile::tempdir().unwrap();
        let socket = tmp.path().join("run/tessera.sock");
        let first = bind(&socket).unwrap();
        let err = bind(&socket).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse);
        assert!(err.to_string().contains("another tesserad with the same runtime_dir"), "{err}");
        assert!(tokio::net::UnixStream::connect(&socket).await.is_ok(), "the first one still serves");
        drop(first);
        let _second = bind(&socket).expect("a stale socket is replaced");
    }
}
