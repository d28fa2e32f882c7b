//! The context sizes file (`context-sizes` in an allocation's directory, beside `limits`): what a
//! CUDA context takes on each GPU, measured by tesserad, so that a process of the allocation can
//! charge its first context without loading NVML to measure it (most of what a process paid to
//! start under the shim).
//!
//! Written only by tesserad (root, 0644, atomically), in a directory the container sees through
//! a read-only mount, like `limits`: as far as a tenant can change this file, it can change its
//! limits. The region's `context_hint` is no substitute: every process of the container can write
//! it. Read by the shim with one small read and no allocation beyond the entries. Anything but a
//! well-formed file of sane figures is refused whole ([`ContextSizes::parse`] answers `None`), and
//! the shim then measures the context as before.
//!
//! ```text
//! tessera-context-sizes 1
//! GPU-5a1c0b62-0e7e-4f5b-8c1e-2b8a3d9e4f10 268435456
//! ```
//!
//! One line per GPU: its UUID as NVML and `cuDeviceGetUuid` spell it, and the bytes a context
//! (the primary context, default flags) took on it.

use std::io::Read;
use std::path::Path;

/// The file's name in an allocation directory.
pub const CONTEXT_SIZES_FILE: &str = "context-sizes";
/// The first line: the format and its version.
pub const CONTEXT_SIZES_HEADER: &str = "tessera-context-sizes 1";
/// No figure below this is believed (no driver's context is this small).
pub const CONTEXT_MIN: u64 = 1 << 20;
/// No figure above this is believed (the shim's ceiling for any context estimate).
pub const CONTEXT_MAX: u64 = 2 << 30;
/// Entries a file may hold (a node's GPUs; more is not a file tesserad wrote).
pub const CONTEXT_SIZES_MAX: usize = 64;
/// Bytes a file may hold.
const MAX_BYTES: usize = 8192;

/// The parsed file: (GPU UUID, bytes) per GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContextSizes {
    entries: Vec<(String, u64)>,
}

impl ContextSizes {
    /// An empty table.
    pub fn new() -> ContextSizes {
        ContextSizes::default()
    }

    /// Sets a GPU's figure; `false` (nothing changed) for a figure out of range or a UUID that
    /// is not one.
    pub fn set(&mut self, uuid: &str, bytes: u64) -> bool {
        if !valid_uuid(uuid) || !(CONTEXT_MIN..=CONTEXT_MAX).contains(&bytes) {
            return false;
        }
        if let Some(e) = self.entries.iter_mut().find(|(u, _)| u.eq_ignore_ascii_case(uuid)) {
            e.1 = bytes;
            return true;
        }
        if self.entries.len() >= CONTEXT_SIZES_MAX {
            return false;
        }
        self.entries.push((uuid.to_string(), bytes));
        true
    }

    /// A GPU's figure, by UUID (case-insensitive).
    pub fn get(&self, uuid: &str) -> Option<u64> {
        self.entries.iter().find(|(u, _)| u.eq_ignore_ascii_case(uuid)).map(|e| e.1)
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entries, in the file's order.
    pub fn entries(&self) -> &[(String, u64)] {
        &self.entries
    }

    /// Parses a file's text; `None` for anything but the exact format with every figure in
    /// [`CONTEXT_MIN`]..=[`CONTEXT_MAX`] and no GPU twice (never a part of a damaged file).
    pub fn parse(text: &str) -> Option<ContextSizes> {
        if text.len() > MAX_BYTES {
            return None;
        }
        let mut lines = text.split('\n');
        if lines.next()? != CONTEXT_SIZES_HEADER {
            return None;
        }
        let mut out = ContextSizes::new();
        for line in lines {
            if line.is_empty() {
                continue;
            }
            let (uuid, bytes) = line.split_once(' ')?;
            if !bytes.bytes().all(|b| b.is_ascii_digit()) || bytes.len() > 12 {
                return None;
            }
            let bytes: u64 = bytes.parse().ok()?;
            if out.get(uuid).is_some() || !out.set(uuid, bytes) {
                return None;
            }
        }
        Some(out)
    }

    /// Reads and parses a file; `None` when it is missing, unreadable, too big or not well formed.
    pub fn load(path: &Path) -> Option<ContextSizes> {
        let mut f = std::fs::File::open(path).ok()?;
        let mut buf = [0u8; MAX_BYTES + 1];
        let mut n = 0;
        while n < buf.len() {
            match f.read(&mut buf[n..]) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return None,
            }
        }
        ContextSizes::parse(std::str::from_utf8(&buf[..n]).ok()?)
    }

    /// The file's text.
    pub fn to_text(&self) -> String {
        let mut s = format!("{CONTEXT_SIZES_HEADER}\n");
        for (u, b) in &self.entries {
            s.push_str(&format!("{u} {b}\n"));
        }
        s
    }

    /// Writes the file atomically, 0644 (readers in containers run as any uid).
    pub fn write_atomic(&self, path: &Path) -> std::io::Result<()> {
        crate::limits::write_file_atomic(path, self.to_text().as_bytes(), 0o644)
    }

    /// [`Self::write_atomic`], readable by its owner only (tesserad's own copy in its state).
    pub fn write_atomic_private(&self, path: &Path) -> std::io::Result<()> {
        crate::limits::write_file_atomic(path, self.to_text().as_bytes(), 0o600)
    }
}

/// `GPU-` or `MIG-` and 1 to 60 hexadecimal digits and dashes.
fn valid_uuid(u: &str) -> bool {
    let rest = u.strip_prefix("GPU-").or_else(|| u.strip_prefix("MIG-"));
    rest.is_some_and(|r| !r.is_empty() && r.len() <= 60 && r.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "GPU-5a1c0b62-0e7e-4f5b-8c1e-2b8a3d9e4f10";
    const B: &str = "GPU-00000000-0000-0000-0000-000000000001";

    #[test]
    fn a_written_file_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(CONTEXT_SIZES_FILE);
        let mut t = ContextSizes::new();
        assert!(t.set(A, 256 << 20));
        assert!(t.set(B, 32 << 20));
        assert!(t.set(A, 500 << 20));
        t.write_atomic(&path).unwrap();
        let back = ContextSizes::load(&path).unwrap();
        assert_eq!(back, t);
        assert_eq!(back.get(&A.to_lowercase()), Some(500 << 20));
        assert_eq!(back.get("GPU-ffff"), None);
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o644);
        assert_eq!(ContextSizes::load(&dir.path().join("missing")), None);
    }

    #[test]
    fn anything_but_a_well_formed_file_of_sane_figures_is_refused_whole() {
        let ok = format!("{CONTEXT_SIZES_HEADER}\n{A} 268435456\n");
        assert!(ContextSizes::parse(&ok).is_some());
        assert!(ContextSizes::parse(&format!("{CONTEXT_SIZES_HEADER}\n")).unwrap().is_empty());
        let bad = [
            String::new(),
            format!("{A} 268435456\n"),
            format!("tessera-context-sizes 2\n{A} 268435456\n"),
            // Out of the sane range: a forged small figure, a huge one, zero.
            format!("{CONTEXT_SIZES_HEADER}\n{A} 4096\n"),
            format!("{CONTEXT_SIZES_HEADER}\n{A} 0\n"),
            format!("{CONTEXT_SIZES_HEADER}\n{A} 3221225472\n"),
            format!("{CONTEXT_SIZES_HEADER}\n{A} 99999999999999999999999\n"),
            format!("{CONTEXT_SIZES_HEADER}\n{A} -268435456\n"),
            format!("{CONTEXT_SIZES_HEADER}\n{A} +268435456\n"),
            format!("{CONTEXT_SIZES_HEADER}\n{A} 2.5e8\n"),
            format!("{CONTEXT_SIZES_HEADER}\n{A}  268435456\n"),
            format!("{CONTEXT_SIZES_HEADER}\n{A}\n"),
            format!("{CONTEXT_SIZES_HEADER}\nnot-a-uuid 268435456\n"),
            format!("{CONTEXT_SIZES_HEADER}\nGPU-zz 268435456\n"),
            // One good line beside a bad one: nothing believed.
            format!("{CONTEXT_SIZES_HEADER}\n{A} 268435456\n{B} 1\n"),
            format!("{CONTEXT_SIZES_HEADER}\n{A} 268435456\n{A} 268435456\n"),
            format!("{CONTEXT_SIZES_HEADER}\n{A} 268435456\ngarbage\n"),
            format!("{CONTEXT_SIZES_HEADER}\n{}", format!("{A} 268435456\n").repeat(300)),
        ];
        for b in &bad {
            assert_eq!(ContextSizes::parse(b), None, "{b:?}");
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(CONTEXT_SIZES_FILE);
        std::fs::write(&path, [0xffu8, 0xfe, 0x00, 0x41]).unwrap();
        assert_eq!(ContextSizes::load(&path), None);
        assert!(!ContextSizes::new().set(A, CONTEXT_MIN - 1));
        assert!(!ContextSizes::new().set("GPU-", CONTEXT_MIN));
    }
}
