//! What the CUDA half of the simulated driver needs beyond the rest of the model: reading a
//! process's fault mark exactly once, and which contexts the model still counts for it.

use std::sync::atomic::Ordering::*;

use crate::Node;
use crate::layout::UNITS;

impl Node {
    /// Takes this process's sticky fault mark (see [`Node::sticky_xid`]): returns it and clears it,
    /// so that each fault (an XID aimed at the process, or a reset that destroyed its contexts) is
    /// seen exactly once. The CUDA layer turns it into errors on the contexts it destroyed.
    pub fn take_sticky_xid(&self) -> Option<u32> {
        match self.region.own_proc()?.sticky_xid.swap(0, AcqRel) {
            0 => None,
            x => Some(x),
        }
    }

    /// The execution units of a GPU on which the model counts a context of this process (bit per
    /// unit, as [`Node::context_opened`] sets them); a reset of the GPU clears them.
    pub fn own_context_units(&self, gpu: u32) -> u32 {
        let units = self.region.own_proc().and_then(|p| p.ctx_units.get(gpu as usize));
        units.map_or(0, |u| u.load(Acquire) & ((1 << UNITS) - 1))
    }
}
