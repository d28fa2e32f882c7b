//! `TESSERA_SIM_TRACE=1`: the sim tells on stderr what a program asked of it and did not get
//! (names `cuGetProcAddress` does not know, export tables it does not serve, table entries it does
//! not model), so that a program that fails on the sim shows what is missing.

use std::io::Write;
use std::sync::OnceLock;

/// Whether tracing is on (read once).
pub(crate) fn on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("TESSERA_SIM_TRACE").is_some_and(|v| !v.is_empty() && v != "0"))
}

/// Writes one trace line (never fails, never panics).
pub(crate) fn line(args: std::fmt::Arguments<'_>) {
    if on() {
        let _ = writeln!(std::io::stderr().lock(), "tessera-sim: {args}");
    }
}
