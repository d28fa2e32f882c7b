//! Allocation state: the crash-safe store of allocation records and the per-allocation
//! directories (`limits` + `region`) the shim reads.
//!
//! - [`record`]: the allocation record (what was handed out, to whom, with which limits).
//! - [`store`]: the records in an append-only journal, one checksummed frame per change, flushed
//!   before the call returns (the kubelet's new records a moment after); survives `kill -9` at any moment without losing or duplicating a
//!   committed allocation.
//! - [`journal`]: the journal's on-disk format (frames, replay scan, preallocation).
//! - [`journal_flush`]: the group flush of the kubelet's new records, off its `Allocate`'s way.
//! - [`durable`]: crash-safe whole-file writes (the event log, layout overrides).
//! - [`alloc_dir`]: `<runtime_dir>/alloc/<id>/`: the limits file and the accounting region.
//! - [`dir_events`]: which of those directories had files written into them (inotify).
//! - [`load`]: what the records hold per physical device, summed beside the index (admission).
//! - [`recover`]: records rebuilt from those directories when the journal lost them.

pub mod alloc_dir;
pub mod dir_events;
pub mod durable;
pub mod holders;
pub mod journal;
pub mod journal_flush;
pub mod load;
pub mod mount;
pub mod record;
pub mod recover;
pub mod store;

pub use alloc_dir::{AllocDirError, AllocDirs};
pub use record::{AllocatedDevice, Allocation, Claim, ContainerIdentity, Lease, Source};
pub use store::{Loss, SetAside, StateError, Store};
