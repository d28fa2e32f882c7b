//! The limits file: what the shim enforces for one container.
//!
//! The daemon writes it (TOML) into the per-allocation directory and rewrites it atomically to
//! change limits live; the shim reads it at start and again when the region's config generation
//! changes. Standalone (no daemon), the same limits come from `TESSERA_*` environment variables.
//!
//! ```toml
//! version = 1
//! container = "alloc-7f3a"
//! priority = "normal"            # low | normal | high
//! compute_mode = "strict"        # strict | work-conserving
//!
//! [[devices]]
//! uuid = "GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f"   # or MIG-…, "index:N" (CUDA ordinal), "*" (all)
//! memory_limit = 8589934592      # bytes; a size string such as "8GiB" is accepted too
//! sm_percent = 30                # 1..=100
//! ```
//!
//! A malformed file is an error, never "no limits": the shim fails closed on it.

use std::fmt;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::region::MAX_UUID_LEN;

/// Path of a limits file; when set it wins over the other variables (but not over
/// [`CONTAINER_ALLOC_DIR`]).
pub const ENV_LIMITS: &str = "TESSERA_LIMITS";
/// Where tessera-hook, the runtime wrapper and the CDI specs mount a container's allocation
/// directory: read-only (`limits`, `ledger`), its `region` read-write. Where `limits` is there,
/// the limiter takes the limits, the region and the ledger from this directory whatever its
/// environment says: a tenant writes its own environment, never that mount.
pub const CONTAINER_ALLOC_DIR: &str = "/run/tessera/alloc";
/// Standalone memory limit: `"8GiB"`, or per CUDA ordinal `"0=8GiB,1=4GiB"`.
pub const ENV_MEMORY_LIMIT: &str = "TESSERA_MEMORY_LIMIT";
/// Standalone SM share: `"30"`, or per CUDA ordinal `"0=30,1=50"`.
pub const ENV_SM_PERCENT: &str = "TESSERA_SM_PERCENT";
/// Standalone priority: `low`, `normal` or `high`.
pub const ENV_PRIORITY: &str = "TESSERA_PRIORITY";
/// Standalone compute mode: `strict` or `work-conserving`.
pub const ENV_COMPUTE_MODE: &str = "TESSERA_COMPUTE_MODE";
/// The limits file format version this build reads and writes.
pub const LIMITS_VERSION: u32 = 1;
/// The device key that applies to every device without a more specific entry.
pub const ALL_DEVICES: &str = "*";

/// A setting's values by their names in the limits file (the names serde reads and writes):
/// `ALL`, `as_str`, `from_name` (ASCII case and surrounding blanks ignored) and `Display`, from
/// one list of `Variant = "name"`.
macro_rules! named_values {
    ($ty:ident, $count:literal: $($variant:ident = $name:literal),+) => {
        impl $ty {
            pub const ALL: [$ty; $count] = [$($ty::$variant),+];

            /// The value's name in the limits file.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($ty::$variant => $name),+
                }
            }

            /// The value named `name`.
            pub fn from_name(name: &str) -> Option<$ty> {
                $ty::ALL.into_iter().find(|v| v.as_str().eq_ignore_ascii_case(name.trim()))
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Priority {
    Low,
    #[default]
    Normal,
    High,
}

named_values!(Priority, 3: Low = "low", Normal = "normal", High = "high");

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ComputeMode {
    /// The SM share is a ceiling, even when the GPU is otherwise idle.
    #[default]
    Strict,
    /// The SM share is a guarantee; idle time may be used beyond it.
    WorkConserving,
}

named_values!(ComputeMode, 2: Strict = "strict", WorkConserving = "work-conserving");

/// The limits of one device, or of a class of devices (`index:N`, `*`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceLimits {
    /// `"GPU-…"` / `"MIG-…"`; from the environment: `"*"` (all devices) or `"index:N"` (CUDA ordinal N).
    pub uuid: String,
    /// Bytes of device memory the container may hold on the device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_limit: Option<u64>,
    /// Share of the device's SMs, 1..=100.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm_percent: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Format version: [`LIMITS_VERSION`].
    pub version: u32,
    /// The allocation / container id, for reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    #[serde(default)]
    pub priority: Priority,
    #[serde(default)]
    pub compute_mode: ComputeMode,
    #[serde(default)]
    pub devices: Vec<DeviceLimits>,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            version: LIMITS_VERSION,
            container: None,
            priority: Priority::Normal,
            compute_mode: ComputeMode::Strict,
            devices: Vec::new(),
        }
    }
}

/// What is wrong with a limits file or limits variable. Every variant names the key (or variable)
/// or the file, and the reason: `devices[1].sm_percent: 0 is not in 1..=100`,
/// `TESSERA_MEMORY_LIMIT: "8QB" is not a size`.
#[derive(Debug, thiserror::Error)]
pub enum LimitsError {
    /// A key or variable with a bad, missing or unknown value.
    #[error("{key}: {reason}")]
    Invalid { key: String, reason: String },
    /// The text is not TOML.
    #[error("not valid TOML: {0}")]
    Syntax(String),
    /// The file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// An error inside a file, with the file's path.
    #[error("{}: {source}", path.display())]
    File {
        path: PathBuf,
        #[source]
        source: Box<LimitsError>,
    },
}

impl LimitsError {
    fn invalid(key: impl Into<String>, reason: impl Into<String>) -> LimitsError {
        LimitsError::Invalid { key: key.into(), reason: reason.into() }
    }

    /// The key or variable at fault, when one is.
    pub fn key(&self) -> Option<&str> {
        match self {
            LimitsError::Invalid { key, .. } => Some(key),
            LimitsError::File { source, .. } => source.key(),
            _ => None,
        }
    }
}

impl Limits {
    /// Parses a limits file's text: TOML, unknown keys refused, every value validated.
    pub fn parse(text: &str) -> Result<Limits, LimitsError> {
        let table: toml::Table = text.parse().map_err(|e: toml::de::Error| syntax_error(text, &e))?;
        let limits = from_table(table)?;
        limits.validate()?;
        Ok(limits)
    }

    /// Reads and parses a limits file; errors name the path.
    pub fn load(path: &Path) -> Result<Limits, LimitsError> {
        Limits::load_with_metadata(path).map(|(l, _)| l)
    }

    /// [`Limits::load`], with the metadata of the file it read, taken from the open file: it
    /// describes exactly what was parsed (a look by path could see a file replaced in between).
    /// One open, one `fstat`, reads until the end and a close: what a process start pays.
    pub fn load_with_metadata(path: &Path) -> Result<(Limits, std::fs::Metadata), LimitsError> {
        use std::io::Read;
        let io = |source| LimitsError::Io { path: path.to_path_buf(), source };
        let mut file = std::fs::File::open(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        // Sized from the metadata and read to the end by hand: `read_to_string` would ask the
        // file's size and position again.
        let mut buf = vec![0u8; usize::try_from(meta.len()).unwrap_or(0).saturating_add(1).max(256)];
        let mut n = 0;
        loop {
            if n == buf.len() {
                buf.resize(buf.len() * 2, 0);
            }
            match file.read(&mut buf[n..]) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io(e)),
            }
        }
        buf.truncate(n);
        let text = String::from_utf8(buf).map_err(|_| {
            io(std::io::Error::new(std::io::ErrorKind::InvalidData, "stream did not contain valid UTF-8"))
        })?;
        let limits =
            Limits::parse(&text).map_err(|e| LimitsError::File { path: path.to_path_buf(), source: Box::new(e) })?;
        Ok((limits, meta))
    }

    /// Limits for standalone use, from the environment (`get` is `std::env::var(..).ok()` or a test's map):
    /// [`ENV_LIMITS`] names a file and wins; otherwise [`ENV_MEMORY_LIMIT`] (`"8GiB"`, `"512MiB"`,
    /// `"1.5GB"`, `"8589934592"`, or per CUDA ordinal `"0=8GiB,1=4GiB"`), [`ENV_SM_PERCENT`] (`"30"` or
    /// `"0=30,1=50"`), [`ENV_PRIORITY`], [`ENV_COMPUTE_MODE`]. `None` when none is set (empty counts
    /// as unset). A per-ordinal list may also hold one bare value for the other devices: `"4GiB,0=8GiB"`.
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Option<Limits>, LimitsError> {
        let var = |name: &str| get(name).filter(|v| !v.trim().is_empty());
        if let Some(path) = var(ENV_LIMITS) {
            return Limits::load(Path::new(path.trim())).map(Some);
        }
        let memory = var(ENV_MEMORY_LIMIT);
        let sm = var(ENV_SM_PERCENT);
        let priority = var(ENV_PRIORITY);
        let mode = var(ENV_COMPUTE_MODE);
        if memory.is_none() && sm.is_none() && priority.is_none() && mode.is_none() {
            return Ok(None);
        }
        let memory = memory.map(|v| per_device(ENV_MEMORY_LIMIT, &v, memory_value)).transpose()?.unwrap_or_default();
        let sm = sm.map(|v| per_device(ENV_SM_PERCENT, &v, percent_value)).transpose()?.unwrap_or_default();
        let mut limits = Limits::default();
        if let Some(p) = priority {
            limits.priority = Priority::from_name(&p)
                .ok_or_else(|| LimitsError::invalid(ENV_PRIORITY, format!("{p:?} is not one of low, normal, high")))?;
        }
        if let Some(m) = mode {
            limits.compute_mode = ComputeMode::from_name(&m).ok_or_else(|| {
                LimitsError::invalid(ENV_COMPUTE_MODE, format!("{m:?} is not one of strict, work-conserving"))
            })?;
        }
        let mut ordinals: Vec<u32> =
            memory.by_ordinal.iter().map(|&(o, _)| o).chain(sm.by_ordinal.iter().map(|&(o, _)| o)).collect();
        ordinals.sort_unstable();
        ordinals.dedup();
        // An entry for an ordinal is chosen over "*" as a whole, so it carries the "*" values it
        // does not override.
        for o in ordinals {
            limits.devices.push(DeviceLimits {
                uuid: format!("index:{o}"),
                memory_limit: memory.get(o).or(memory.all),
                sm_percent: sm.get(o).or(sm.all),
            });
        }
        if memory.all.is_some() || sm.all.is_some() {
            limits.devices.push(DeviceLimits {
                uuid: ALL_DEVICES.into(),
                memory_limit: memory.all,
                sm_percent: sm.all,
            });
        }
        limits.validate()?;
        Ok(Some(limits))
    }

    /// Checks what the types do not: version, device keys (form, length, no duplicates), memory
    /// limits above 0, SM shares in 1..=100. [`Limits::parse`] and [`Limits::from_env`] call it;
    /// call it on limits built in code before writing them.
    pub fn validate(&self) -> Result<(), LimitsError> {
        if self.version != LIMITS_VERSION {
            return Err(LimitsError::invalid(
                "version",
                format!("{} is not supported (this build reads version {LIMITS_VERSION})", self.version),
            ));
        }
        if let Some(c) = &self.container
            && c.trim().is_empty()
        {
            return Err(LimitsError::invalid("container", "is empty (leave the key out for none)"));
        }
        for (i, d) in self.devices.iter().enumerate() {
            let key = |field: &str| format!("devices[{i}].{field}");
            if let Err(reason) = check_device_key(&d.uuid) {
                return Err(LimitsError::invalid(key("uuid"), reason));
            }
            if let Some(j) = self.devices[..i].iter().position(|e| e.uuid.eq_ignore_ascii_case(&d.uuid)) {
                return Err(LimitsError::invalid(
                    key("uuid"),
                    format!("{:?} is already given in devices[{j}]", d.uuid),
                ));
            }
            if d.memory_limit == Some(0) {
                return Err(LimitsError::invalid(
                    key("memory_limit"),
                    "0 is not a limit (leave the key out for no limit)",
                ));
            }
            if let Some(p) = d.sm_percent
                && !(1..=100).contains(&p)
            {
                return Err(LimitsError::invalid(key("sm_percent"), format!("{p} is not in 1..=100")));
            }
        }
        Ok(())
    }

    /// The limits as a limits file's text (sizes in bytes); [`Limits::parse`] reads it back equal.
    pub fn to_toml(&self) -> String {
        // Plain data of strings, integers and arrays of tables: serialization cannot fail.
        toml::to_string(self).unwrap_or_else(|e| unreachable!("limits serialize to TOML: {e}"))
    }

    /// Writes the limits file so that readers see the old file or the new one, never half of one:
    /// a temporary file in the same directory, fsynced, renamed over `path`, then the directory
    /// fsynced. Mode 0644 (container processes of any uid read it). Invalid limits are refused
    /// (`InvalidInput`): the shim would refuse them anyway. The directory must be what is mounted
    /// into containers; a bind mount of the file alone keeps showing the old inode.
    pub fn write_atomic(&self, path: &Path) -> std::io::Result<()> {
        self.validate().map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
        write_file_atomic(path, self.to_toml().as_bytes(), 0o644)
    }

    /// The limits that apply to a device: the entry of its exact UUID, else `index:N` for its CUDA
    /// ordinal, else `*`. One entry applies as a whole; fields are not merged across entries.
    pub fn device(&self, uuid: &str, ordinal: u32) -> Option<&DeviceLimits> {
        self.devices
            .iter()
            .find(|d| d.uuid.eq_ignore_ascii_case(uuid))
            .or_else(|| self.devices.iter().find(|d| index_key(&d.uuid) == Some(ordinal)))
            .or_else(|| self.devices.iter().find(|d| d.uuid == ALL_DEVICES))
    }
}

/// `index:N` → N.
fn index_key(key: &str) -> Option<u32> {
    let n = key.strip_prefix("index:")?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    n.parse().ok()
}

fn check_device_key(key: &str) -> Result<(), String> {
    if key == ALL_DEVICES || index_key(key).is_some() {
        return Ok(());
    }
    let upper = key.get(..4).map(|p| p.to_ascii_uppercase());
    let prefixed = matches!(upper.as_deref(), Some("GPU-" | "MIG-")) && key.len() > 4;
    if !prefixed || !key.bytes().all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\') {
        return Err(format!("{key:?} is not a device (GPU-…, MIG-…, index:N or *)"));
    }
    if key.len() > MAX_UUID_LEN {
        return Err(format!("{key:?} is longer than {MAX_UUID_LEN} bytes"));
    }
    Ok(())
}

fn syntax_error(text: &str, e: &toml::de::Error) -> LimitsError {
    let msg = e.message().trim_end();
    match e.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |p| p + 1) + 1;
            LimitsError::Syntax(format!("line {line}, column {column}: {msg}"))
        }
        None => LimitsError::Syntax(msg.to_string()),
    }
}

fn type_name(v: &toml::Value) -> &'static str {
    match v {
        toml::Value::String(_) => "a string",
        toml::Value::Integer(_) => "an integer",
        toml::Value::Float(_) => "a float",
        toml::Value::Boolean(_) => "a boolean",
        toml::Value::Datetime(_) => "a date-time",
        toml::Value::Array(_) => "an array",
        toml::Value::Table(_) => "a table",
    }
}

fn wrong_type(key: &str, expected: &str, v: &toml::Value) -> LimitsError {
    LimitsError::invalid(key, format!("expected {expected}, found {}", type_name(v)))
}

fn refuse_unknown(table: &toml::Table, prefix: &str, known: &[&str]) -> Result<(), LimitsError> {
    match table.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => {
            Err(LimitsError::invalid(format!("{prefix}{k}"), format!("unknown key (known: {})", known.join(", "))))
        }
        None => Ok(()),
    }
}

fn from_table(mut t: toml::Table) -> Result<Limits, LimitsError> {
    refuse_unknown(&t, "", &["version", "container", "priority", "compute_mode", "devices"])?;
    let version = match t.remove("version") {
        None => return Err(LimitsError::invalid("version", format!("missing (expected version = {LIMITS_VERSION})"))),
        Some(toml::Value::Integer(v)) => u32::try_from(v).map_err(|_| {
            LimitsError::invalid("version", format!("{v} is not supported (this build reads version {LIMITS_VERSION})"))
        })?,
        Some(v) => return Err(wrong_type("version", "an integer", &v)),
    };
    let container = match t.remove("container") {
        None => None,
        Some(toml::Value::String(s)) => Some(s),
        Some(v) => return Err(wrong_type("container", "a string", &v)),
    };
    let priority = match t.remove("priority") {
        None => Priority::default(),
        Some(toml::Value::String(s)) => Priority::from_name(&s)
            .ok_or_else(|| LimitsError::invalid("priority", format!("{s:?} is not one of low, normal, high")))?,
        Some(v) => return Err(wrong_type("priority", "a string", &v)),
    };
    let compute_mode = match t.remove("compute_mode") {
        None => ComputeMode::default(),
        Some(toml::Value::String(s)) => ComputeMode::from_name(&s).ok_or_else(|| {
            LimitsError::invalid("compute_mode", format!("{s:?} is not one of strict, work-conserving"))
        })?,
        Some(v) => return Err(wrong_type("compute_mode", "a string", &v)),
    };
    let devices = match t.remove("devices") {
        None => Vec::new(),
        Some(toml::Value::Array(items)) => {
            items.into_iter().enumerate().map(|(i, v)| device_from_value(i, v)).collect::<Result<_, _>>()?
        }
        Some(v) => return Err(wrong_type("devices", "an array of tables ([[devices]])", &v)),
    };
    Ok(Limits { version, container, priority, compute_mode, devices })
}

fn device_from_value(i: usize, v: toml::Value) -> Result<DeviceLimits, LimitsError> {
    let prefix = format!("devices[{i}].");
    let key = |field: &str| format!("{prefix}{field}");
    let toml::Value::Table(mut t) = v else {
        return Err(wrong_type(&format!("devices[{i}]"), "a table", &v));
    };
    refuse_unknown(&t, &prefix, &["uuid", "memory_limit", "sm_percent"])?;
    let uuid = match t.remove("uuid") {
        None => return Err(LimitsError::invalid(key("uuid"), "missing")),
        Some(toml::Value::String(s)) => s,
        Some(v) => return Err(wrong_type(&key("uuid"), "a string", &v)),
    };
    let memory_limit = match t.remove("memory_limit") {
        None => None,
        Some(toml::Value::Integer(n)) => Some(
            u64::try_from(n)
                .map_err(|_| LimitsError::invalid(key("memory_limit"), format!("{n} is not a size in bytes")))?,
        ),
        Some(toml::Value::String(s)) => Some(parse_size(&s).map_err(|r| LimitsError::invalid(key("memory_limit"), r))?),
        Some(v) => return Err(wrong_type(&key("memory_limit"), "bytes (an integer) or a size such as \"8GiB\"", &v)),
    };
    let sm_percent = match t.remove("sm_percent") {
        None => None,
        Some(toml::Value::Integer(n)) => Some(
            u32::try_from(n).map_err(|_| LimitsError::invalid(key("sm_percent"), format!("{n} is not in 1..=100")))?,
        ),
        Some(v) => return Err(wrong_type(&key("sm_percent"), "an integer in 1..=100", &v)),
    };
    Ok(DeviceLimits { uuid, memory_limit, sm_percent })
}

/// Parses a size: bytes (`"8589934592"`), or a number with a unit: binary `KiB MiB GiB TiB`
/// (also `Ki Mi Gi Ti`), decimal `KB MB GB TB` (also `K M G T`), or `B`; units ignore ASCII case,
/// fractions are allowed where they make whole bytes (`"1.5GB"`, `"0.5GiB"`).
/// The error is the reason, such as `"8QB" is not a size`.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let not_a_size = || format!("{text:?} is not a size");
    let s = text.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (number, unit) = (&s[..split], s[split..].trim());
    let multiplier: u128 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "m" | "mb" => 1_000_000,
        "g" | "gb" => 1_000_000_000,
        "t" | "tb" => 1_000_000_000_000,
        "ki" | "kib" => 1 << 10,
        "mi" | "mib" => 1 << 20,
        "gi" | "gib" => 1 << 30,
        "ti" | "tib" => 1 << 40,
        _ => return Err(not_a_size()),
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty()
        || !whole.bytes().all(|b| b.is_ascii_digit())
        || !fraction.bytes().all(|b| b.is_ascii_digit())
        || number.ends_with('.')
    {
        return Err(not_a_size());
    }
    let too_large = || format!("{text:?} is more than {} bytes", u64::MAX);
    let fraction = fraction.trim_end_matches('0');
    if fraction.len() > 18 {
        return Err(format!("{text:?} has more fraction digits than bytes can have"));
    }
    let whole: u128 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| too_large())? };
    let scale = 10u128.pow(fraction.len() as u32);
    let frac: u128 = if fraction.is_empty() { 0 } else { fraction.parse().map_err(|_| not_a_size())? };
    let frac_bytes = frac * multiplier;
    if !frac_bytes.is_multiple_of(scale) {
        return Err(format!("{text:?} is not a whole number of bytes"));
    }
    let bytes = whole.checked_mul(multiplier).and_then(|b| b.checked_add(frac_bytes / scale)).ok_or_else(too_large)?;
    u64::try_from(bytes).map_err(|_| too_large())
}

/// Parses a size a person wrote (the configuration's `memory`, `TESSERA_MEMORY_LIMIT`): as
/// [`parse_size`], but the unit is required. A bare number is refused: `8` would be 8 bytes to
/// this parser but 8 MiB to a HAMi user. Units as in Kubernetes: `Ki Mi Gi Ti` (or `KiB` …) are
/// powers of 1024, `K M G T` (or `KB` …) powers of 1000, `B` bytes.
pub fn parse_size_with_unit(text: &str) -> Result<u64, String> {
    let s = text.trim();
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return Err(format!(
            "{text:?} has no unit: write \"{s}GiB\" (GiB = 2^30 bytes), \"{s}GB\" (GB = 10^9 bytes), \"{s}MiB\" or \"{s}B\" (bytes)"
        ));
    }
    parse_size(text)
}

/// A size for people: `8 GiB`, `512 MiB`, `1.5 GiB`, `100 B` (in GiB from 1 GiB, MiB from 1 MiB;
/// up to two decimals).
pub fn human_size(bytes: u64) -> String {
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    let fmt = |v: f64, unit: &str| {
        let t = format!("{v:.2}");
        format!("{} {unit}", t.trim_end_matches('0').trim_end_matches('.'))
    };
    if bytes >= GIB {
        fmt(bytes as f64 / GIB as f64, "GiB")
    } else if bytes >= MIB {
        fmt(bytes as f64 / MIB as f64, "MiB")
    } else {
        format!("{bytes} B")
    }
}

/// A variable's value for all devices and per CUDA ordinal.
struct PerDevice<T> {
    all: Option<T>,
    by_ordinal: Vec<(u32, T)>,
}

impl<T> Default for PerDevice<T> {
    fn default() -> Self {
        PerDevice { all: None, by_ordinal: Vec::new() }
    }
}

impl<T: Copy> PerDevice<T> {
    fn get(&self, ordinal: u32) -> Option<T> {
        self.by_ordinal.iter().find(|&&(o, _)| o == ordinal).map(|&(_, v)| v)
    }
}

/// `"V"`, or `"0=V,1=V"`, or both (`"V,1=V"`; `"*=V"` is the same as a bare `V`).
fn per_device<T: Copy>(
    var: &str,
    text: &str,
    value: impl Fn(&str) -> Result<T, String>,
) -> Result<PerDevice<T>, LimitsError> {
    let mut out = PerDevice::default();
    for item in text.split(',').map(str::trim) {
        if item.is_empty() {
            return Err(LimitsError::invalid(var, format!("{text:?} has an empty item")));
        }
        let (ordinal, v) = match item.split_once('=') {
            None => (None, item),
            Some((k, v)) if k.trim() == ALL_DEVICES => (None, v.trim()),
            Some((k, v)) => {
                let k = k.trim();
                let o =
                    k.parse::<u32>().ok().filter(|_| k.bytes().all(|b| b.is_ascii_digit())).ok_or_else(|| {
                        LimitsError::invalid(var, format!("{k:?} is not a device ordinal (in {item:?})"))
                    })?;
                (Some(o), v.trim())
            }
        };
        let v = value(v).map_err(|reason| LimitsError::invalid(var, reason))?;
        match ordinal {
            None if out.all.is_some() => {
                return Err(LimitsError::invalid(var, format!("{text:?} gives the value for all devices twice")));
            }
            None => out.all = Some(v),
            Some(o) if out.get(o).is_some() => {
                return Err(LimitsError::invalid(var, format!("{text:?} gives device {o} twice")));
            }
            Some(o) => out.by_ordinal.push((o, v)),
        }
    }
    Ok(out)
}

fn memory_value(v: &str) -> Result<u64, String> {
    match parse_size_with_unit(v)? {
        0 => Err(format!("{v:?} is not a limit (unset the variable for no limit)")),
        n => Ok(n),
    }
}

fn percent_value(v: &str) -> Result<u32, String> {
    let digits = v.strip_suffix('%').unwrap_or(v).trim();
    let n: u64 = digits
        .parse()
        .ok()
        .filter(|_| digits.bytes().all(|b| b.is_ascii_digit()))
        .ok_or_else(|| format!("{v:?} is not a percentage"))?;
    if !(1..=100).contains(&n) {
        return Err(format!("{v:?} is not in 1..=100"));
    }
    Ok(n as u32)
}

/// Writes `bytes` to `path` so that readers see the old file or the new one: temporary file in
/// the same directory, fsync, rename, fsync of the directory.
pub(crate) fn write_file_atomic(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{}: not a file path", path.display()))
    })?;
    let tmp =
        dir.join(format!(".{}.{}.{}.tmp", name.to_string_lossy(), std::process::id(), crate::sys::monotonic_ns()));
    let result = (|| {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(&tmp)?;
        // The umask may have narrowed the mode; readers in containers run as any uid.
        f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn err(text: &str) -> String {
        Limits::parse(text).unwrap_err().to_string()
    }

    fn env(vars: &[(&str, &str)]) -> Result<Option<Limits>, LimitsError> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Limits::from_env(|k| map.get(k).cloned())
    }

    fn env_err(vars: &[(&str, &str)]) -> String {
        env(vars).unwrap_err().to_string()
    }

    const FULL: &str = r#"
version = 1
container = "alloc-7f3a"
priority = "high"
compute_mode = "work-conserving"

[[devices]]
uuid = "GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f"
memory_limit = 8589934592
sm_percent = 30

[[devices]]
uuid = "MIG-7f3a0000-0000-0000-0000-000000000001"
memory_limit = "4GiB"

[[devices]]
uuid = "*"
sm_percent = 100
"#;

    #[test]
    fn a_file_is_read_whole_with_the_metadata_of_what_was_read() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("limits");
        // Longer than the first read's buffer would be from a stale size: read to the end.
        let big = format!("{FULL}\n{}", "# padding\n".repeat(2000));
        std::fs::write(&path, &big).unwrap();
        let (l, meta) = Limits::load_with_metadata(&path).unwrap();
        assert_eq!(l, Limits::parse(FULL).unwrap());
        let now = std::fs::metadata(&path).unwrap();
        assert_eq!((meta.ino(), meta.len()), (now.ino(), big.len() as u64));
        // Replaced (as tesserad writes it: a new file renamed over it): the new inode's metadata.
        std::fs::write(dir.path().join("next"), "version = 1\n").unwrap();
        std::fs::rename(dir.path().join("next"), &path).unwrap();
        let (l, meta) = Limits::load_with_metadata(&path).unwrap();
        assert_eq!(l, Limits::default());
        assert_ne!(meta.ino(), now.ino());
        std::fs::write(&path, b"version = 1\n\xff\n").unwrap();
        let e = Limits::load_with_metadata(&path).unwrap_err().to_string();
        assert!(e.contains("UTF-8") && e.contains(&path.display().to_string()), "{e}");
    }

    #[test]
    fn parses_a_full_file() {
        let l = Limits::parse(FULL).unwrap();
        assert_eq!(l.version, 1);
        assert_eq!(l.container.as_deref(), Some("alloc-7f3a"));
        assert_eq!(l.priority, Priority::High);
        assert_eq!(l.compute_mode, ComputeMode::WorkConserving);
        assert_eq!(l.devices.len(), 3);
        assert_eq!(l.devices[0].memory_limit, Some(8 << 30));
        assert_eq!(l.devices[0].sm_percent, Some(30));
        assert_eq!(l.devices[1].memory_limit, Some(4 << 30));
        assert_eq!(l.devices[1].sm_percent, None);
        assert_eq!(l.devices[2].uuid, "*");
    }

    #[test]
    fn defaults() {
        let l = Limits::parse("version = 1").unwrap();
        assert_eq!(l, Limits::default());
        assert_eq!(l.priority, Priority::Normal);
        assert_eq!(l.compute_mode, ComputeMode::Strict);
    }

    #[test]
    fn every_error_names_its_key() {
        let cases: &[(&str, &str)] = &[
            ("", "version: missing (expected version = 1)"),
            ("version = 2", "version: 2 is not supported (this build reads version 1)"),
            ("version = -1", "version: -1 is not supported"),
            ("version = \"1\"", "version: expected an integer, found a string"),
            ("version = 1\ncolour = 3", "colour: unknown key"),
            ("version = 1\ncontainer = 5", "container: expected a string, found an integer"),
            ("version = 1\ncontainer = \" \"", "container: is empty"),
            ("version = 1\npriority = \"urgent\"", "priority: \"urgent\" is not one of low, normal, high"),
            ("version = 1\npriority = 1", "priority: expected a string, found an integer"),
            ("version = 1\ncompute_mode = \"fair\"", "compute_mode: \"fair\" is not one of strict, work-conserving"),
            ("version = 1\ndevices = 3", "devices: expected an array of tables ([[devices]]), found an integer"),
            ("version = 1\ndevices = [1]", "devices[0]: expected a table, found an integer"),
            ("version = 1\n[[devices]]\nmemory_limit = 1", "devices[0].uuid: missing"),
            ("version = 1\n[[devices]]\nuuid = 7", "devices[0].uuid: expected a string, found an integer"),
            ("version = 1\n[[devices]]\nuuid = \"nvidia0\"", "devices[0].uuid: \"nvidia0\" is not a device"),
            ("version = 1\n[[devices]]\nuuid = \"index:x\"", "devices[0].uuid: \"index:x\" is not a device"),
            ("version = 1\n[[devices]]\nuuid = \"GPU-a\"\nmemroy_limit = 1", "devices[0].memroy_limit: unknown key"),
            (
                "version = 1\n[[devices]]\nuuid = \"GPU-a\"\nmemory_limit = -1",
                "devices[0].memory_limit: -1 is not a size",
            ),
            (
                "version = 1\n[[devices]]\nuuid = \"GPU-a\"\nmemory_limit = 0",
                "devices[0].memory_limit: 0 is not a limit",
            ),
            (
                "version = 1\n[[devices]]\nuuid = \"GPU-a\"\nmemory_limit = \"8QB\"",
                "devices[0].memory_limit: \"8QB\" is not a size",
            ),
            (
                "version = 1\n[[devices]]\nuuid = \"GPU-a\"\nmemory_limit = 1.5",
                "devices[0].memory_limit: expected bytes",
            ),
            (
                "version = 1\n[[devices]]\nuuid = \"GPU-a\"\nsm_percent = 50.5",
                "devices[0].sm_percent: expected an integer in 1..=100, found a float",
            ),
            (
                "version = 1\n[[devices]]\nuuid = \"GPU-a\"\n[[devices]]\nuuid = \"GPU-b\"\nsm_percent = 0",
                "devices[1].sm_percent: 0 is not in 1..=100",
            ),
            (
                "version = 1\n[[devices]]\nuuid = \"GPU-a\"\n[[devices]]\nuuid = \"GPU-b\"\nsm_percent = 101",
                "devices[1].sm_percent: 101 is not in 1..=100",
            ),
            (
                "version = 1\n[[devices]]\nuuid = \"GPU-a\"\nsm_percent = -3",
                "devices[0].sm_percent: -3 is not in 1..=100",
            ),
            (
                "version = 1\n[[devices]]\nuuid = \"GPU-a\"\n[[devices]]\nuuid = \"gpu-A\"",
                "devices[1].uuid: \"gpu-A\" is already given in devices[0]",
            ),
        ];
        for (text, want) in cases {
            let got = err(text);
            assert!(got.starts_with(want), "for {text:?}\n  got:  {got}\n  want: {want}…");
        }
        let long = format!("version = 1\n[[devices]]\nuuid = \"GPU-{}\"", "a".repeat(70));
        assert!(
            err(&long).starts_with("devices[0].uuid: ") && err(&long).contains("longer than 64 bytes"),
            "{}",
            err(&long)
        );
    }

    #[test]
    fn key_accessor() {
        let e = Limits::parse("version = 1\n[[devices]]\nuuid = \"GPU-a\"\nsm_percent = 0").unwrap_err();
        assert_eq!(e.key(), Some("devices[0].sm_percent"));
    }

    #[test]
    fn syntax_errors_give_line_and_column() {
        let e = err("version = 1\npriority = \n");
        assert!(e.starts_with("not valid TOML: line 2, column "), "{e}");
        let e = err("version = 1\nversion = 1\n");
        assert!(e.starts_with("not valid TOML: line 2"), "{e}");
    }

    #[test]
    fn sizes() {
        let ok: &[(&str, u64)] = &[
            ("8GiB", 8 << 30),
            ("512MiB", 512 << 20),
            ("1.5GB", 1_500_000_000),
            ("1.5GiB", 3 << 29),
            ("8589934592", 8589934592),
            ("8 GiB", 8 << 30),
            ("8gib", 8 << 30),
            ("8Gi", 8 << 30),
            ("8G", 8_000_000_000),
            ("4KiB", 4096),
            ("4kb", 4000),
            ("100B", 100),
            ("0.5KiB", 512),
            (".5KiB", 512),
            ("1TiB", 1 << 40),
            ("2.000GB", 2_000_000_000),
            ("18446744073709551615", u64::MAX),
        ];
        for (s, want) in ok {
            assert_eq!(parse_size(s), Ok(*want), "{s}");
        }
        let bad: &[(&str, &str)] = &[
            ("8QB", "\"8QB\" is not a size"),
            ("", "\"\" is not a size"),
            ("GiB", "\"GiB\" is not a size"),
            ("1.2.3GB", "\"1.2.3GB\" is not a size"),
            ("8.GiB", "\"8.GiB\" is not a size"),
            ("-1GiB", "\"-1GiB\" is not a size"),
            ("1.5B", "\"1.5B\" is not a whole number of bytes"),
            ("0.3KiB", "\"0.3KiB\" is not a whole number of bytes"),
            ("18446744073709551616", "is more than"),
            ("20000000TiB", "is more than"),
        ];
        for (s, want) in bad {
            let got = parse_size(s).unwrap_err();
            assert!(got.contains(want), "{s}: {got}");
        }
    }

    #[test]
    fn sizes_people_write_need_a_unit() {
        assert_eq!(parse_size_with_unit("8Gi"), Ok(8 << 30));
        assert_eq!(parse_size_with_unit("8G"), Ok(8_000_000_000));
        assert_eq!(parse_size_with_unit("8B"), Ok(8));
        let e = parse_size_with_unit("8").unwrap_err();
        assert!(e.contains("no unit") && e.contains("GiB") && e.contains("10^9"), "{e}");
        assert!(parse_size_with_unit("1.5").is_err());
        assert!(parse_size_with_unit("8QB").unwrap_err().contains("not a size"));
        assert_eq!(human_size(8 << 30), "8 GiB");
        assert_eq!(human_size(3 << 29), "1.5 GiB");
        assert_eq!(human_size(512 << 20), "512 MiB");
        assert_eq!(human_size(100), "100 B");
    }

    #[test]
    fn env_none_when_unset() {
        assert!(env(&[]).unwrap().is_none());
        assert!(env(&[(ENV_MEMORY_LIMIT, ""), (ENV_SM_PERCENT, "  ")]).unwrap().is_none());
    }

    #[test]
    fn env_global_values() {
        let l = env(&[(ENV_MEMORY_LIMIT, "8GiB"), (ENV_SM_PERCENT, "30"), (ENV_PRIORITY, "low")]).unwrap().unwrap();
        assert_eq!(l.priority, Priority::Low);
        assert_eq!(l.compute_mode, ComputeMode::Strict);
        assert_eq!(
            l.devices,
            vec![DeviceLimits { uuid: "*".into(), memory_limit: Some(8 << 30), sm_percent: Some(30) }]
        );
        for (v, want) in [("512MiB", 512u64 << 20), ("1.5GB", 1_500_000_000), ("8589934592B", 8 << 30)] {
            let l = env(&[(ENV_MEMORY_LIMIT, v)]).unwrap().unwrap();
            assert_eq!(l.devices[0].memory_limit, Some(want), "{v}");
        }
        let l = env(&[(ENV_COMPUTE_MODE, "work-conserving")]).unwrap().unwrap();
        assert_eq!(l.compute_mode, ComputeMode::WorkConserving);
        assert!(l.devices.is_empty());
    }

    #[test]
    fn env_per_ordinal() {
        let l = env(&[(ENV_MEMORY_LIMIT, "0=8GiB,1=4GiB"), (ENV_SM_PERCENT, "0=30, 2=50%")]).unwrap().unwrap();
        assert_eq!(
            l.devices,
            vec![
                DeviceLimits { uuid: "index:0".into(), memory_limit: Some(8 << 30), sm_percent: Some(30) },
                DeviceLimits { uuid: "index:1".into(), memory_limit: Some(4 << 30), sm_percent: None },
                DeviceLimits { uuid: "index:2".into(), memory_limit: None, sm_percent: Some(50) },
            ]
        );
        assert_eq!(l.device("GPU-x", 1).unwrap().memory_limit, Some(4 << 30));
        assert!(l.device("GPU-x", 3).is_none());

        // A global value and per-ordinal ones of the other variable: each ordinal entry keeps the global value.
        let l = env(&[(ENV_MEMORY_LIMIT, "2GiB"), (ENV_SM_PERCENT, "1=50")]).unwrap().unwrap();
        assert_eq!(
            l.device("GPU-x", 1).unwrap(),
            &DeviceLimits { uuid: "index:1".into(), memory_limit: Some(2 << 30), sm_percent: Some(50) }
        );
        assert_eq!(l.device("GPU-x", 0).unwrap().uuid, "*");
        assert_eq!(l.device("GPU-x", 0).unwrap().memory_limit, Some(2 << 30));

        // A bare value among per-ordinal ones is the default for the others.
        let l = env(&[(ENV_MEMORY_LIMIT, "4GiB,0=8GiB")]).unwrap().unwrap();
        assert_eq!(l.device("GPU-x", 0).unwrap().memory_limit, Some(8 << 30));
        assert_eq!(l.device("GPU-x", 5).unwrap().memory_limit, Some(4 << 30));
    }

    #[test]
    fn env_errors_name_the_variable() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[(ENV_MEMORY_LIMIT, "8QB")], "TESSERA_MEMORY_LIMIT: \"8QB\" is not a size"),
            (&[(ENV_MEMORY_LIMIT, "0B")], "TESSERA_MEMORY_LIMIT: \"0B\" is not a limit"),
            (&[(ENV_MEMORY_LIMIT, "8")], "TESSERA_MEMORY_LIMIT: \"8\" has no unit: write \"8GiB\""),
            (&[(ENV_MEMORY_LIMIT, "0=512")], "TESSERA_MEMORY_LIMIT: \"512\" has no unit"),
            (&[(ENV_MEMORY_LIMIT, "0=8GiB,x=1GiB")], "TESSERA_MEMORY_LIMIT: \"x\" is not a device ordinal"),
            (&[(ENV_MEMORY_LIMIT, "0=8GiB,0=1GiB")], "TESSERA_MEMORY_LIMIT: \"0=8GiB,0=1GiB\" gives device 0 twice"),
            (&[(ENV_MEMORY_LIMIT, "1GiB,2GiB")], "TESSERA_MEMORY_LIMIT: \"1GiB,2GiB\" gives the value for all"),
            (&[(ENV_MEMORY_LIMIT, "0=8GiB,")], "TESSERA_MEMORY_LIMIT: \"0=8GiB,\" has an empty item"),
            (&[(ENV_MEMORY_LIMIT, "0=8QB")], "TESSERA_MEMORY_LIMIT: \"8QB\" is not a size"),
            (&[(ENV_SM_PERCENT, "0")], "TESSERA_SM_PERCENT: \"0\" is not in 1..=100"),
            (&[(ENV_SM_PERCENT, "101")], "TESSERA_SM_PERCENT: \"101\" is not in 1..=100"),
            (&[(ENV_SM_PERCENT, "0=30,1=abc")], "TESSERA_SM_PERCENT: \"abc\" is not a percentage"),
            (&[(ENV_SM_PERCENT, "-5")], "TESSERA_SM_PERCENT: \"-5\" is not a percentage"),
            (&[(ENV_PRIORITY, "urgent")], "TESSERA_PRIORITY: \"urgent\" is not one of low, normal, high"),
            (&[(ENV_COMPUTE_MODE, "fair")], "TESSERA_COMPUTE_MODE: \"fair\" is not one of strict, work-conserving"),
        ];
        for (vars, want) in cases {
            let got = env_err(vars);
            assert!(got.starts_with(want), "for {vars:?}\n  got:  {got}\n  want: {want}…");
        }
    }

    #[test]
    fn env_limits_file_wins_and_errors_name_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("limits");
        std::fs::write(&path, FULL).unwrap();
        let l = env(&[(ENV_LIMITS, path.to_str().unwrap()), (ENV_MEMORY_LIMIT, "1GiB")]).unwrap().unwrap();
        assert_eq!(l, Limits::parse(FULL).unwrap());

        std::fs::write(&path, "version = 1\n[[devices]]\nuuid = \"GPU-a\"\nsm_percent = 0\n").unwrap();
        let e = env_err(&[(ENV_LIMITS, path.to_str().unwrap())]);
        assert_eq!(e, format!("{}: devices[0].sm_percent: 0 is not in 1..=100", path.display()));

        let missing = dir.path().join("nope");
        let e = Limits::load(&missing).unwrap_err().to_string();
        assert!(e.starts_with(&format!("{}: ", missing.display())), "{e}");
    }

    #[test]
    fn toml_round_trip() {
        let l = Limits::parse(FULL).unwrap();
        let text = l.to_toml();
        assert_eq!(Limits::parse(&text).unwrap(), l, "{text}");
        assert!(text.contains("[[devices]]"), "{text}");
        assert!(text.contains("compute_mode = \"work-conserving\""), "{text}");
        assert_eq!(Limits::parse(&Limits::default().to_toml()).unwrap(), Limits::default());
    }

    #[test]
    fn write_atomic_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("limits");
        let mut l = Limits::parse(FULL).unwrap();
        l.write_atomic(&path).unwrap();
        assert_eq!(Limits::load(&path).unwrap(), l);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o644);

        // Rewriting replaces the file (a new inode: open readers keep the old one whole).
        let ino = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&path).unwrap());
        l.devices[0].sm_percent = Some(55);
        l.write_atomic(&path).unwrap();
        assert_eq!(Limits::load(&path).unwrap().devices[0].sm_percent, Some(55));
        assert_ne!(ino, std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&path).unwrap()));
        // No temporary files left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);

        // Invalid limits are not written.
        l.devices[0].sm_percent = Some(0);
        let e = l.write_atomic(&path).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains("devices[0].sm_percent"), "{e}");
        assert_eq!(Limits::load(&path).unwrap().devices[0].sm_percent, Some(55));
    }

    #[test]
    fn device_precedence() {
        let l = Limits::parse(
            r#"
version = 1
[[devices]]
uuid = "*"
memory_limit = 1
[[devices]]
uuid = "index:1"
memory_limit = 2
[[devices]]
uuid = "GPU-aaaa"
memory_limit = 3
"#,
        )
        .unwrap();
        let m = |uuid: &str, ord: u32| l.device(uuid, ord).and_then(|d| d.memory_limit);
        assert_eq!(m("GPU-aaaa", 1), Some(3), "exact UUID first");
        assert_eq!(m("GPU-AAAA", 0), Some(3), "UUIDs compare without case");
        assert_eq!(m("GPU-bbbb", 1), Some(2), "then the CUDA ordinal");
        assert_eq!(m("GPU-bbbb", 0), Some(1), "then *");
        let only_exact = Limits::parse("version = 1\n[[devices]]\nuuid = \"GPU-aaaa\"").unwrap();
        assert!(only_exact.device("GPU-bbbb", 0).is_none());
    }

    #[test]
    fn serde_names() {
        assert_eq!(
            toml::to_string(&DeviceLimits { uuid: "*".into(), memory_limit: None, sm_percent: None }).unwrap().trim(),
            "uuid = \"*\""
        );
        #[derive(Serialize)]
        struct W {
            p: Priority,
            m: ComputeMode,
        }
        let s = toml::to_string(&W { p: Priority::High, m: ComputeMode::WorkConserving }).unwrap();
        assert!(s.contains("p = \"high\"") && s.contains("m = \"work-conserving\""), "{s}");
    }
}
