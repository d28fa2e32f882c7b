//! What the CUDA half of the simulated driver needs beyond the rest of the model: reading a
//! process's fault mark exactly once, and which contexts the model still counts for it.

use std::sync::atomic::Ordering::*;

use crate::Node;
use crate::layout::{MAX_GPUS, UNITS};

impl Node {
    /// Takes this process's sticky fault mark (see [`Node::sticky_xid`]): returns it and clears it,
    /// so that each fault (an XID aimed at the process, or a reset that destroyed its contexts) is
    /// seen exactly once. The CUDA layer turns it into errors on the contexts it destroyed.
    pub fn take_sticky_xid(&self) -> Option<u32> {
        let slot = self.region.own_slot_if_any()?;
        match self.region.shared().procs[slot].sticky_xid.swap(0, AcqRel) {
            0 => None,
            x => Some(x),
        }
    }

    /// The execution units of a GPU on which the model counts a context of this process (bit per
    /// unit, as [`Node::context_opened`] sets them); a reset of the GPU clears them.
    pub fn own_context_units(&self, gpu: u32) -> u32 {
        match self.region.own_slot_if_any() {
            Some(s) if (gpu as usize) < MAX_GPUS => {
                self.region.shared().procs[s].ctx_units[gpu as usize].load(Acquire) & ((1 << UNITS) - 1)
            }
            _ => 0,
        }
    }
}
