//! The process's one connection to the simulated node, opened on first use (never at load time)
//! from TESSERA_SIM_STATE / TESSERA_SIM_NODE, and renewed in a forked child.

use std::sync::OnceLock;

use tessera_sim_model::{Node, SimError};

static NODE: OnceLock<Result<Node, SimError>> = OnceLock::new();

/// The node, or why it could not be opened (reported once on stderr).
pub fn node() -> Result<&'static Node, &'static SimError> {
    NODE.get_or_init(|| {
        let r = Node::open_from_env();
        match &r {
            Ok(_) => {
                // SAFETY: registering a fork handler with a plain extern "C" fn is always sound.
                unsafe { libc::pthread_atfork(None, None, Some(after_fork_child)) };
            }
            Err(e) => eprintln!("tessera-sim: cannot open the simulated node: {e}"),
        }
        r
    })
    .as_ref()
}

extern "C" fn after_fork_child() {
    if let Some(Ok(n)) = NODE.get() {
        n.after_fork_in_child();
    }
}
