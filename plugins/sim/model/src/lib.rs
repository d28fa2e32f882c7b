//! The simulated GPU node's device model.
//!
//! Every process on the node (the daemon, workloads, `tessera-sim`, any NVML tool) maps one state
//! file and sees one device model through it: the driver library (`tessera-sim-driver`) is a thin
//! ABI layer over this crate. The model owns what a real driver owns: memory per GPU and per
//! process, kernel time on each GPU shared among processes, MIG instances, faults and events.
//!
//! Crash safety: one process-shared *robust* mutex guards mutations; a process killed while
//! holding it hands it to the next locker (`EOWNERDEAD`), which repairs the state. Each process
//! marks its slot alive with an open-file-description lock, which the kernel drops at death, so
//! anyone can tell a dead process's slot and reclaim its memory.

pub mod catalog;
mod checkpoint;
mod clock;
mod compute;
pub mod driver_root;
mod events;
mod ext_cuda;
pub mod faults;
mod layout;
mod memory;
mod mig;
pub mod node;
mod region;

use std::path::{Path, PathBuf};

pub use catalog::{CiProfile, GiProfile, GpuModel, MigSpec};
pub use checkpoint::{CheckpointOp, CheckpointRequest, ProcessState};
pub use clock::{monotonic_ns, realtime_us_from_monotonic};
pub use compute::{EventMark, StreamId, Ticket, UtilWindow};
pub use events::{Event, EventCursor, EventKind};
pub use layout::{MAX_GPUS, MAX_MIG, MAX_PROCS, MAX_STREAMS};
pub use memory::{MemoryInfo, ProcessUsage};
pub use mig::{ComputeInstance, GpuInstance, MigModeChange};
pub use node::{GpuIdentity, NodeDescription, TopologyLevel, VirtualizationMode};

use region::Region;

/// Environment variable naming the node description (TOML). Unset: the built-in 8 x H100 node.
pub const ENV_NODE: &str = "TESSERA_SIM_NODE";
/// Environment variable naming the state file. Unset: a per-description file under the runtime dir.
pub const ENV_STATE: &str = "TESSERA_SIM_STATE";

/// What the model can refuse. The ABI layers map these to NVML and CUDA return codes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SimError {
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("out of memory")]
    OutOfMemory,
    #[error("GPU {0} has fallen off the bus")]
    GpuLost(u32),
    #[error("in use: {0}")]
    InUse(String),
    #[error("insufficient resources: {0}")]
    InsufficientResources(String),
    #[error("not supported: {0}")]
    NotSupported(String),
    #[error("too many {0}")]
    TooMany(&'static str),
    #[error("timed out")]
    Timeout,
    #[error("state file: {0}")]
    State(String),
    #[error("node description: {0}")]
    Description(String),
}

pub type Result<T> = std::result::Result<T, SimError>;

/// One process's view of the simulated node: the mapped state plus the parsed description.
pub struct Node {
    region: Region,
    description: NodeDescription,
    gpus: Vec<GpuIdentity>,
    state_path: PathBuf,
}

impl Node {
    /// Opens the node named by the environment (`TESSERA_SIM_STATE`, `TESSERA_SIM_NODE`),
    /// creating its state file on first use.
    pub fn open_from_env() -> Result<Node> {
        let description_path = std::env::var_os(ENV_NODE).map(PathBuf::from);
        let state_path = std::env::var_os(ENV_STATE).map(PathBuf::from);
        Node::open(description_path.as_deref(), state_path.as_deref())
    }

    /// Opens (or creates) the state file for a description. With no description path the
    /// built-in default node is used; with no state path, the default path for that description.
    pub fn open(description_path: Option<&Path>, state_path: Option<&Path>) -> Result<Node> {
        let wanted = match description_path {
            Some(p) => Some(NodeDescription::load(p)?),
            None => None,
        };
        let state_path = match state_path {
            Some(p) => p.to_path_buf(),
            None => {
                let d = wanted.clone().unwrap_or_else(NodeDescription::default_node);
                node::default_state_path(&d)
            }
        };
        Node::open_state(&state_path, wanted)
    }

    /// Opens an existing state file, or creates it from `wanted` (default node if `None`).
    /// An existing file made for another description than `wanted` is refused.
    pub fn open_state(state_path: &Path, wanted: Option<NodeDescription>) -> Result<Node> {
        let create_from = wanted.clone().unwrap_or_else(NodeDescription::default_node);
        let region = Region::open_or_create(state_path, &create_from)?;
        let text = region.description_text()?;
        let description = NodeDescription::parse(&text)
            .map_err(|e| SimError::State(format!("{}: embedded description: {e}", state_path.display())))?;
        if let Some(w) = wanted
            && w.canonical_text() != description.canonical_text()
        {
            return Err(SimError::State(format!(
                "{} was made for another node description; remove it or point {ENV_STATE} elsewhere",
                state_path.display()
            )));
        }
        let gpus = description.identities();
        Ok(Node { region, description, gpus, state_path: state_path.to_path_buf() })
    }

    /// Where this node's state lives.
    pub fn state_path(&self) -> &Path {
        &self.state_path
    }

    /// The description this node was made from.
    pub fn description(&self) -> &NodeDescription {
        &self.description
    }

    /// Static identity of every GPU, in NVML index order.
    pub fn gpus(&self) -> &[GpuIdentity] {
        &self.gpus
    }

    /// Static identity of one GPU.
    pub fn gpu(&self, index: u32) -> Result<&GpuIdentity> {
        self.gpus.get(index as usize).ok_or_else(|| SimError::NotFound(format!("GPU index {index}")))
    }

    /// Whether the GPU has fallen off the bus (set by fault injection, cleared by a reset).
    pub fn is_lost(&self, gpu: u32) -> bool {
        self.region.gpu(gpu).is_some_and(|g| g.lost.load(std::sync::atomic::Ordering::Acquire) != 0)
    }

    /// Fails with `GpuLost` when the GPU is off the bus.
    pub fn check_gpu(&self, gpu: u32) -> Result<()> {
        self.gpu(gpu)?;
        if self.is_lost(gpu) { Err(SimError::GpuLost(gpu)) } else { Ok(()) }
    }

    /// Gives a forked child its own open file description, so that the parent's liveness lock
    /// and process slot are never mistaken for the child's. Call from a `pthread_atfork` child hook.
    pub fn after_fork_in_child(&self) {
        self.region.after_fork_in_child();
    }
}

#[cfg(test)]
mod testutil;
