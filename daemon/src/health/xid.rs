//! What an XID means for the device that raised it, after NVIDIA's XID catalog
//! (<https://docs.nvidia.com/deploy/xid-errors/>): caused by an application (attributed to the
//! container, the device stays in service), informational (reported only), or fatal (the device
//! leaves service until a reset brings it back). XIDs the table does not know are fatal, as the
//! Kubernetes NVIDIA device plugin treats every XID it does not skip.
//!
//! `[health] ignored_xids` makes an XID application-caused and `fatal_xids` makes one fatal,
//! whatever the table says.

use crate::config::Health;

/// What an XID does to the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Caused by an application: attributed to the container(s) holding the device, which stays
    /// healthy.
    Application,
    /// Informational (corrected, recorded): reported, the device stays healthy.
    Benign,
    /// The device leaves service until a reset. With `gpu_wide`, the whole GPU even when the
    /// event names one MIG instance; otherwise only that instance (or the GPU when none is named).
    Fatal { gpu_wide: bool },
}

/// One catalog entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XidPolicy {
    pub xid: u32,
    pub action: Action,
    /// The catalog's short description.
    pub what: &'static str,
}

const fn entry(xid: u32, action: Action, what: &'static str) -> XidPolicy {
    XidPolicy { xid, action, what }
}

use Action::{Application as App, Benign};
const FATAL: Action = Action::Fatal { gpu_wide: false };
const GPU_FATAL: Action = Action::Fatal { gpu_wide: true };

/// The catalog, by XID.
pub const TABLE: &[XidPolicy] = &[
    // Graphics engine exception: almost always a faulting kernel (out-of-range access, illegal
    // instruction); the driver kills the context.
    entry(13, App, "graphics engine exception"),
    // GPU memory page fault: an application's illegal address (MMU fault).
    entry(31, App, "GPU memory page fault"),
    // Invalid or corrupted push buffer stream: driver or system memory / bus corruption.
    entry(32, FATAL, "invalid or corrupted push buffer stream"),
    // Driver firmware error.
    entry(38, FATAL, "driver firmware error"),
    // GPU stopped processing: the channel of a faulting application was reset.
    entry(43, App, "GPU stopped processing (channel reset)"),
    // Preemptive cleanup after earlier errors (an application killed or exiting).
    entry(45, App, "preemptive cleanup"),
    // Double-bit ECC error: uncorrectable memory error; under MIG it names the instance hit.
    entry(48, FATAL, "double-bit ECC error"),
    // Error programming the video memory interface: hardware.
    entry(57, FATAL, "error programming video memory interface"),
    // Internal micro-controller breakpoint / halt: firmware; the GPU needs a reset.
    entry(61, FATAL, "internal micro-controller breakpoint"),
    entry(62, FATAL, "internal micro-controller halt"),
    // ECC page retirement / row remapping recorded: the remap succeeded and takes effect at the
    // next reset; the device keeps working.
    entry(63, Benign, "row remapping recorded"),
    // ECC page retirement / row remapping failed: memory can no longer be repaired.
    entry(64, GPU_FATAL, "row remapping failure"),
    // Video processor (NVDEC) exception: the application's stream.
    entry(68, App, "video processor exception"),
    // Graphics engine class error: an application's invalid method / class use.
    entry(69, App, "graphics engine class error"),
    // NVLink error: the link (and the GPU's peers over it) is unreliable.
    entry(74, GPU_FATAL, "NVLink error"),
    // GPU has fallen off the bus: every call fails until a reset.
    entry(79, GPU_FATAL, "GPU has fallen off the bus"),
    // High single-bit ECC error rate: memory failing.
    entry(92, FATAL, "high single-bit ECC error rate"),
    // Contained ECC error: the affected contexts were killed; under MIG only that instance.
    entry(94, FATAL, "contained ECC error"),
    // Uncontained ECC error: every context on the GPU is affected.
    entry(95, GPU_FATAL, "uncontained ECC error"),
    // Context switch timeout: an application's kernel would not yield.
    entry(109, App, "context switch timeout"),
    // GSP RPC timeout / GSP error: the GPU system processor stopped answering.
    entry(119, GPU_FATAL, "GSP RPC timeout"),
    entry(120, GPU_FATAL, "GSP error"),
    // C2C link corrected error.
    entry(121, Benign, "C2C link corrected error"),
    // Unrecovered ECC error (Hopper and later).
    entry(140, FATAL, "unrecovered ECC error"),
    // GPU recovery action changed: informational.
    entry(154, Benign, "GPU recovery action changed"),
];

/// The catalog's entry for `xid`.
pub fn catalog(xid: u32) -> Option<&'static XidPolicy> {
    TABLE.iter().find(|p| p.xid == xid)
}

/// What `xid` does under `config`: the configured lists first, then the catalog, else fatal.
pub fn classify(xid: u32, config: &Health) -> (Action, &'static str) {
    let what = catalog(xid).map_or("not in the XID catalog", |p| p.what);
    if config.ignored_xids.contains(&xid) {
        return (Action::Application, what);
    }
    if config.fatal_xids.contains(&xid) {
        let gpu_wide = matches!(catalog(xid), Some(XidPolicy { action: Action::Fatal { gpu_wide: true }, .. }));
        return (Action::Fatal { gpu_wide }, what);
    }
    match catalog(xid) {
        Some(p) => (p.action, p.what),
        None => (FATAL, what),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_sorted_and_unique() {
        assert!(TABLE.windows(2).all(|w| w[0].xid < w[1].xid));
    }

    #[test]
    fn catalog_classes() {
        let c = Health::default();
        for xid in [13, 31, 43, 45, 68, 69, 109] {
            assert_eq!(classify(xid, &c).0, Action::Application, "XID {xid}");
        }
        for xid in [48, 94, 92] {
            assert_eq!(classify(xid, &c).0, Action::Fatal { gpu_wide: false }, "XID {xid}");
        }
        for xid in [64, 74, 79, 95, 119, 120] {
            assert_eq!(classify(xid, &c).0, Action::Fatal { gpu_wide: true }, "XID {xid}");
        }
        assert_eq!(classify(63, &c).0, Action::Benign, "a recorded row remap is not fatal");
        assert_eq!(classify(999, &c), (Action::Fatal { gpu_wide: false }, "not in the XID catalog"));
    }

    #[test]
    fn configuration_overrides_the_catalog() {
        let c = Health { ignored_xids: vec![48], fatal_xids: vec![13, 63, 95], ..Health::default() };
        assert_eq!(classify(48, &c).0, Action::Application);
        assert_eq!(classify(13, &c).0, Action::Fatal { gpu_wide: false });
        assert_eq!(classify(63, &c).0, Action::Fatal { gpu_wide: false });
        assert_eq!(classify(95, &c).0, Action::Fatal { gpu_wide: true });
    }
}
