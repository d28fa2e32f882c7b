//! Owner-only Unix sockets.
//!
//! `bind` then `chmod` leaves a moment where the socket has the umask's mode and anyone may
//! connect. Instead the socket is bound inside a fresh 0700 directory beside its final path, set
//! to 0600 there, and renamed into place: at its final path it is owner-only from the first
//! instant. `umask` would do too, but it is process-wide and other threads create files.
//!
//! And the client's side of another's socket (the kubelet's): a gRPC endpoint with its timeouts.

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The prefix of a Unix socket path in a listen address (`telemetry.metrics_listen`).
pub const UNIX_PREFIX: &str = "unix:";
/// The longest Unix socket path (`sun_path` less its NUL).
const UNIX_PATH_MAX: usize = 107;

/// A gRPC endpoint on the Unix socket at `path`, connecting and answering within `timeout`.
pub fn unix_endpoint(path: &Path, timeout: std::time::Duration) -> Result<tonic::transport::Endpoint, String> {
    let endpoint =
        tonic::transport::Endpoint::from_shared(format!("unix://{}", path.display())).map_err(|e| e.to_string())?;
    Ok(endpoint.connect_timeout(timeout).timeout(timeout))
}

/// The socket path of a listen address `unix:PATH` (`telemetry.metrics_listen`): `None` when
/// the value is not a `unix:` one; an error saying what is wrong with the path (relative, empty,
/// a directory, too long for a socket).
pub fn unix_path(addr: &str) -> Option<Result<PathBuf, String>> {
    let path = addr.strip_prefix(UNIX_PREFIX)?;
    let example = "as in \"unix:/run/tessera/metrics.sock\"";
    Some(if path.is_empty() {
        Err(format!("no socket path after \"unix:\"; give an absolute path, {example}"))
    } else if !path.starts_with('/') {
        Err(format!("the socket path {path:?} is not absolute; give an absolute path, {example}"))
    } else if path.ends_with('/') || path.split('/').any(|c| c == "." || c == "..") {
        Err(format!("the socket path {path:?} names a directory, not a socket file, {example}"))
    } else if path.contains('\0') {
        Err(format!("the socket path {path:?} holds a NUL byte"))
    } else if path.len() > UNIX_PATH_MAX {
        Err(format!("the socket path is {} bytes; a Unix socket path is at most {UNIX_PATH_MAX}", path.len()))
    } else {
        Ok(PathBuf::from(path))
    })
}

/// Binds a listening Unix socket at `path`, mode 0600, replacing a stale socket there. Refuses to
/// replace anything that is not a socket (a mistyped path must not delete a file).
pub fn bind_owner_only(path: &Path) -> std::io::Result<std::os::unix::net::UnixListener> {
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    path.file_name().ok_or_else(|| invalid(path, "has no file name"))?;
    match std::fs::symlink_metadata(path) {
        Ok(m) if std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => std::fs::remove_file(path)?,
        Ok(_) => return Err(invalid(path, "exists and is not a socket")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let staging = staging_dir(parent)?;
    let result = (|| {
        // One letter: the staged path must fit a socket address wherever the final one does.
        let staged = staging.join("s");
        let listener = std::os::unix::net::UnixListener::bind(&staged)?;
        std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o600))?;
        std::fs::rename(&staged, path)?;
        Ok(listener)
    })();
    let _ = std::fs::remove_dir_all(&staging);
    result
}

/// The same, as a tokio listener (call inside a runtime).
pub fn bind_owner_only_tokio(path: &Path) -> std::io::Result<tokio::net::UnixListener> {
    let listener = bind_owner_only(path)?;
    listener.set_nonblocking(true)?;
    tokio::net::UnixListener::from_std(listener)
}

/// A listener's connections for a gRPC server, pausing after a failed accept. Out of file
/// descriptors (EMFILE: a client holding thousands of idle connections), `accept` fails at once
/// for as long as connections wait, and the server's accept loop, retrying at once, spun a core
/// at 100% and starved the calls it was serving; now it waits [`ACCEPT_PAUSE`] and says why
/// (once per run of failures).
pub struct Incoming {
    listener: tokio::net::UnixListener,
    pause: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    failing: bool,
    what: &'static str,
    rebind: Option<Rebind>,
}

/// The identity of the socket a kept path holds now, shared with whoever removes it at the end.
pub type Ours = std::sync::Arc<std::sync::Mutex<Option<(u64, u64)>>>;

/// A socket path kept bound: looked at every [`REBIND_CHECK`], bound again when it is gone.
struct Rebind {
    path: PathBuf,
    ours: Ours,
    check: tokio::time::Interval,
}

/// How long accepting pauses after it failed.
pub const ACCEPT_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);
/// How often a kept socket path is looked at.
pub const REBIND_CHECK: std::time::Duration = std::time::Duration::from_secs(1);

/// A file's identity (device, inode); `None` when it is not there.
pub fn identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

impl Incoming {
    /// `what` names the socket in the warning ("node API").
    pub fn new(listener: tokio::net::UnixListener, what: &'static str) -> Incoming {
        Incoming { listener, pause: None, failing: false, what, rebind: None }
    }

    /// Keeps `path` (where `listener` is bound) bound: a socket file removed by hand or by a
    /// cleanup left the daemon running unreachable, and clients told "tesserad is not running".
    /// The returned identity is the socket's now (for removing only our own at the end).
    pub fn keeping(mut self, path: &Path) -> (Incoming, Ours) {
        let ours = std::sync::Arc::new(std::sync::Mutex::new(identity(path)));
        let mut check = tokio::time::interval(REBIND_CHECK);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.rebind = Some(Rebind { path: path.to_path_buf(), ours: std::sync::Arc::clone(&ours), check });
        (self, ours)
    }

    /// Binds the kept path again if its socket is gone.
    fn keep_bound(&mut self, cx: &mut std::task::Context<'_>) {
        let Some(r) = self.rebind.as_mut() else { return };
        while r.check.poll_tick(cx).is_ready() {
            if identity(&r.path).is_some() {
                continue;
            }
            match bind_owner_only_tokio(&r.path) {
                Ok(listener) => {
                    self.listener = listener;
                    *r.ours.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = identity(&r.path);
                    tracing::warn!(socket = %r.path.display(), "the socket was removed; bound again");
                }
                Err(e) => {
                    tracing::warn!(socket = %r.path.display(), error = %e, "the socket was removed and cannot be bound again")
                }
            }
        }
    }
}

impl tokio_stream::Stream for Incoming {
    type Item = std::io::Result<tokio::net::UnixStream>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        self.keep_bound(cx);
        loop {
            if let Some(pause) = self.pause.as_mut() {
                if pause.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                self.pause = None;
            }
            match self.listener.poll_accept(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok((stream, _))) => {
                    self.failing = false;
                    return Poll::Ready(Some(Ok(stream)));
                }
                Poll::Ready(Err(e)) => {
                    if !std::mem::replace(&mut self.failing, true) {
                        tracing::warn!(socket = self.what, error = %e, "cannot accept connections; retrying every 100 ms");
                    }
                    self.pause = Some(Box::pin(tokio::time::sleep(ACCEPT_PAUSE)));
                }
            }
        }
    }
}

/// A fresh 0700 directory in `parent`, named short (`.b<pid>-<n>`, n unique in this process) so
/// that a socket staged in it has a path no longer than one at its final place would (the socket's
/// own name in it was doubled before: `<parent>/.<name>.bind-<pid>-0/<name>` passed the 107 bytes
/// of a socket address where `<parent>/<name>` fitted, as the kubelet's DRA registration socket
/// under a longer root directory did).
fn staging_dir(parent: &Path) -> std::io::Result<PathBuf> {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    for _ in 0..16u32 {
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = parent.join(format!(".b{}-{n}", std::process::id()));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                // Left by a crashed earlier run of ours: clear it and try the next name.
                let _ = std::fs::remove_dir_all(&dir);
            }
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::other(format!("cannot make a private directory in {}", parent.display())))
}

fn invalid(path: &Path, why: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{}: {why}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kept socket removed by hand is bound again within a check, and serves.
    #[tokio::test]
    async fn a_kept_socket_removed_is_bound_again() {
        use tokio_stream::StreamExt;
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("api.sock");
        let (mut incoming, ours) = Incoming::new(bind_owner_only_tokio(&path).unwrap(), "test").keeping(&path);
        let first = *ours.lock().unwrap();
        assert_eq!(first, identity(&path));
        let server = tokio::spawn(async move {
            while let Some(conn) = incoming.next().await {
                drop(conn);
            }
        });
        std::fs::remove_file(&path).unwrap();
        tokio::time::sleep(REBIND_CHECK * 2 + std::time::Duration::from_millis(200)).await;
        assert!(tokio::net::UnixStream::connect(&path).await.is_ok(), "bound again");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "owner-only, as at first");
        let now = *ours.lock().unwrap();
        assert!(now.is_some() && now != first && now == identity(&path), "the new socket is ours");
        server.abort();
    }

    /// A socket whose path fits a socket address is bound, however long its name: the staging
    /// path is never longer than the final one (the kubelet's registration socket
    /// `gpu.tessera.io-reg.sock` under `/var/lib/tessera-kube/kubelet/plugins_registry`, 70
    /// bytes, failed with "path must be shorter than SUN_LEN" before).
    #[test]
    fn a_long_socket_name_that_fits_is_bound() {
        let tmp = tempfile::tempdir().unwrap();
        let mut dir = tmp.path().to_path_buf();
        let name = "gpu.tessera.io-reg.sock";
        // Pad the directory so that the final path is 100 bytes: it fits (at most 107).
        let pad = 100 - dir.as_os_str().len() - 2 - name.len();
        dir.push("d".repeat(pad));
        std::fs::create_dir(&dir).unwrap();
        let path = dir.join(name);
        assert_eq!(path.as_os_str().len(), 100);
        let listener = bind_owner_only(&path).unwrap();
        std::os::unix::net::UnixStream::connect(&path).unwrap();
        drop(listener);
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, [std::ffi::OsString::from(name)], "nothing left beside it");
    }

    #[test]
    fn socket_is_owner_only_and_replaces_only_sockets() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("api.sock");
        let first = bind_owner_only(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        drop(first);
        // A stale socket is replaced, and the new one accepts connections.
        let second = bind_owner_only(&path).unwrap();
        std::os::unix::net::UnixStream::connect(&path).unwrap();
        drop(second);
        // Nothing is left beside it.
        let names: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, [std::ffi::OsString::from("api.sock")]);
        // A regular file is never removed.
        let file = tmp.path().join("notes.txt");
        std::fs::write(&file, "keep").unwrap();
        let err = bind_owner_only(&file).unwrap_err();
        assert!(err.to_string().contains("not a socket"), "{err}");
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep");
    }
}
