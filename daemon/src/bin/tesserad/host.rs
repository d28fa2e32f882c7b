//! What tesserad asks of its host: directories only its user can change, systemd's readiness
//! notification, log lines on stderr.

use tessera_daemon::config;

/// Makes `dir` if need be and checks that only this daemon's user can change what is in it: its
/// owner, and not writable by group or others (such bits are taken off, said once). A directory
/// another user owns is refused: that user could replace the journal, the regions or the hook's
/// configuration that root reads.
pub fn own_directory(dir: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if let Ok(m) = std::fs::metadata(dir)
        && !m.is_dir()
    {
        return Err("exists and is not a directory".into());
    }
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let m = std::fs::metadata(dir).map_err(|e| e.to_string())?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if m.uid() != me {
        return Err(format!(
            "owned by uid {}, not by this daemon's uid {me}: that user could change what tesserad keeps there; \
             chown it to uid {me} or configure another directory",
            m.uid()
        ));
    }
    if m.mode() & 0o022 != 0 {
        let mode = m.mode() & 0o7777 & !0o022;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)).map_err(|e| e.to_string())?;
        tracing::warn!(dir = %dir.display(), mode = format!("{mode:o}"), "the directory was writable by other users; no longer");
    }
    Ok(())
}

/// sd_notify by hand: one datagram to `$NOTIFY_SOCKET` (a path, or an abstract name when it
/// starts with '@'); nothing when it is unset.
pub fn sd_notify(state: &str) -> std::io::Result<()> {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixDatagram};
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else { return Ok(()) };
    let socket = UnixDatagram::unbound()?;
    let bytes = std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str());
    let addr = match bytes.strip_prefix(b"@") {
        Some(name) => SocketAddr::from_abstract_name(name)?,
        None => SocketAddr::from_pathname(&path)?,
    };
    socket.send_to_addr(state.as_bytes(), &addr)?;
    Ok(())
}

/// Log lines to stderr, for journald and `kubectl logs`: colours only when stderr is a terminal;
/// `json`: one object per line (level, target, fields, message) for log pipelines.
pub fn init_logging(format: config::LogFormat) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        config::LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        config::LogFormat::Json => builder.json().flatten_event(true).with_ansi(false).init(),
    }
}
