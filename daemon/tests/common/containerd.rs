//! A private containerd for the tests and benches that run containers through it: its own root,
//! state and socket under one directory, killed when dropped.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// A containerd this process started.
pub struct Containerd {
    child: Child,
    /// Its API socket, for `ctr --address`.
    pub sock: PathBuf,
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Containerd {
    /// Starts containerd with `config`, its root, state and socket under `base` (which exists).
    /// The shim runs the runtime wrapper with containerd's environment, so `hook_config` is set
    /// there: the host's default /etc/tessera/hook.toml is not the caller's.
    pub fn start(base: &Path, config: &Path, hook_config: &Path, stdout: File, stderr: File) -> Containerd {
        let sock = base.join("containerd.sock");
        let child = Command::new("containerd")
            .arg("--config")
            .arg(config)
            .arg("--root")
            .arg(base.join("root"))
            .arg("--state")
            .arg(base.join("state"))
            .arg("--address")
            .arg(&sock)
            .env("TESSERA_HOOK_CONFIG", hook_config)
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .expect("containerd");
        Containerd { child, sock }
    }

    /// Whether `ctr version` is answered within 20 s of this call.
    pub fn answers(&self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(20);
        let version = || Command::new("ctr").arg("--address").arg(&self.sock).arg("version").output();
        while !version().is_ok_and(|o| o.status.success()) {
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        true
    }
}
