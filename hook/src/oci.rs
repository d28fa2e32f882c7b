//! The OCI side: a bundle's config.json (read as untyped JSON so that a rewrite keeps every field
//! this crate does not know), the hook's state on stdin, and the wrapper's edits.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};

use crate::plan::{ContainerInfo, InjectError, Plan};

/// At most this much config.json or state is read (a hostile bundle cannot exhaust memory).
pub const MAX_JSON: u64 = 8 << 20;

fn bad(field: &str, reason: impl std::fmt::Display) -> InjectError {
    InjectError(format!("config.json: {field}: {reason}"))
}

/// Reads and parses `<bundle>/config.json`.
pub fn read_config(bundle: &Path) -> Result<Value, InjectError> {
    let path = bundle.join("config.json");
    let text = read_limited(&path).map_err(|e| InjectError(format!("{}: {e}", path.display())))?;
    let v: Value =
        serde_json::from_slice(&text).map_err(|e| InjectError(format!("{}: not valid JSON: {e}", path.display())))?;
    if !v.is_object() {
        return Err(InjectError(format!("{}: not a JSON object", path.display())));
    }
    Ok(v)
}

pub fn read_limited(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let f = std::fs::File::open(path)?;
    // Sized from the file's length (a stat), so the whole file comes in one read and the next
    // sees its end: grown from nothing, a 3 KB config.json took nine reads.
    let len = f.metadata().map_or(0, |m| m.len()).min(MAX_JSON);
    let mut buf = Vec::with_capacity(len as usize + 1);
    f.take(MAX_JSON + 1).read_to_end(&mut buf)?;
    if buf.len() as u64 > MAX_JSON {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "larger than 8 MiB"));
    }
    Ok(buf)
}

/// Writes config.json back in place: the new text over the old from offset 0, padded with
/// trailing spaces (valid JSON whitespace) when shorter, never truncated. Nothing reads the bundle
/// while the wrapper runs (the runtime starts after it), and a rename over the file or a truncate
/// to zero would make ext4 flush it synchronously (auto_da_alloc): milliseconds on every start.
pub fn write_config(bundle: &Path, config: &Value) -> Result<(), InjectError> {
    use std::os::unix::fs::FileExt;
    let path = bundle.join("config.json");
    let err = |e: std::io::Error| InjectError(format!("{}: {e}", path.display()));
    let mut text = serde_json::to_vec(config).map_err(|e| InjectError(format!("{}: {e}", path.display())))?;
    let f = std::fs::OpenOptions::new().write(true).create(true).truncate(false).open(&path).map_err(err)?;
    let old = f.metadata().map_err(err)?.len() as usize;
    if text.len() < old {
        text.resize(old, b' ');
    }
    f.write_all_at(&text, 0).map_err(err)
}

/// The container's env and annotations (plus `extra` annotations, the hook state's).
pub fn container_info(config: &Value, extra: &BTreeMap<String, String>) -> Result<ContainerInfo, InjectError> {
    let mut info = ContainerInfo::default();
    match config.pointer("/process/env") {
        None | Some(Value::Null) => {}
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                let Some(s) = item.as_str() else { return Err(bad(&format!("process.env[{i}]"), "expected a string")) };
                let (k, v) = s.split_once('=').unwrap_or((s, ""));
                info.env.insert(k.to_string(), v.to_string());
            }
        }
        Some(_) => return Err(bad("process.env", "expected an array of strings")),
    }
    match config.get("annotations") {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) => {
            for (k, v) in m {
                let Some(s) = v.as_str() else { return Err(bad(&format!("annotations.{k}"), "expected a string")) };
                info.annotations.insert(k.clone(), s.to_string());
            }
        }
        Some(_) => return Err(bad("annotations", "expected an object")),
    }
    for (k, v) in extra {
        info.annotations.entry(k.clone()).or_insert_with(|| v.clone());
    }
    Ok(info)
}

/// The root file system's host path: `root.path`, relative to the bundle unless absolute.
pub fn root_path(config: &Value, bundle: &Path) -> Result<PathBuf, InjectError> {
    let p = config.pointer("/root/path").ok_or_else(|| bad("root.path", "missing"))?;
    let p = p.as_str().filter(|s| !s.is_empty()).ok_or_else(|| bad("root.path", "expected a non-empty string"))?;
    Ok(bundle.join(p))
}

/// The hook's state (runtime-spec "state"): what the runtime writes on the hook's stdin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct State {
    pub id: String,
    pub pid: i32,
    pub bundle: PathBuf,
    pub annotations: BTreeMap<String, String>,
}

/// Only the container id of a state (a `poststop` hook's: the process is gone, there may be no
/// pid).
pub fn container_id(text: &[u8]) -> Result<String, InjectError> {
    let v: Value = serde_json::from_slice(text).map_err(|e| InjectError(format!("state: not valid JSON: {e}")))?;
    let id = v.get("id").and_then(Value::as_str).filter(|s| !s.is_empty());
    id.map(str::to_string).ok_or_else(|| InjectError("state: id: missing or not a string".into()))
}

pub fn parse_state(text: &[u8]) -> Result<State, InjectError> {
    let bad = |f: &str, r: &str| InjectError(format!("state: {f}: {r}"));
    let v: Value = serde_json::from_slice(text).map_err(|e| InjectError(format!("state: not valid JSON: {e}")))?;
    let id = v.get("id").and_then(Value::as_str).ok_or_else(|| bad("id", "missing or not a string"))?;
    let pid = v.get("pid").and_then(Value::as_i64).ok_or_else(|| bad("pid", "missing or not an integer"))?;
    if pid <= 0 || pid > i32::MAX as i64 {
        return Err(bad("pid", "not a process id"));
    }
    let bundle = v.get("bundle").and_then(Value::as_str).ok_or_else(|| bad("bundle", "missing or not a string"))?;
    if !bundle.starts_with('/') {
        return Err(bad("bundle", "not an absolute path"));
    }
    let mut annotations = BTreeMap::new();
    match v.get("annotations") {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) => {
            for (k, val) in m {
                let s = val.as_str().ok_or_else(|| bad(&format!("annotations.{k}"), "expected a string"))?;
                annotations.insert(k.clone(), s.to_string());
            }
        }
        Some(_) => return Err(bad("annotations", "expected an object")),
    }
    Ok(State { id: id.into(), pid: pid as i32, bundle: bundle.into(), annotations })
}

fn object_at<'a>(v: &'a mut Value, key: &str, field: &str) -> Result<&'a mut Map<String, Value>, InjectError> {
    let obj = v.as_object_mut().ok_or_else(|| bad(field, "expected an object"))?;
    let entry = obj.entry(key.to_string()).or_insert_with(|| json!({}));
    if entry.is_null() {
        *entry = json!({});
    }
    entry.as_object_mut().ok_or_else(|| bad(&format!("{field}.{key}"), "expected an object"))
}

fn array_at<'a>(obj: &'a mut Map<String, Value>, key: &str, field: &str) -> Result<&'a mut Vec<Value>, InjectError> {
    let entry = obj.entry(key.to_string()).or_insert_with(|| json!([]));
    if entry.is_null() {
        *entry = json!([]);
    }
    entry.as_array_mut().ok_or_else(|| bad(field, "expected an array"))
}

/// Adds a `poststop` hook to config.json running `hook poststop --alloc-dir <alloc_dir>` (after
/// the container is deleted): how a leased allocation learns its container is gone. An entry
/// already naming the same hook is replaced, not repeated. The entry sets its environment (as the
/// CDI specs' do): without one runc hands the hook its own, and the hook refuses to run with
/// whatever `LD_LIBRARY_PATH` the runtime's caller had.
pub fn add_poststop(config: &mut Value, hook: &Path, alloc_dir: &Path) -> Result<(), InjectError> {
    let hooks = object_at(config, "hooks", "hooks")?;
    let poststop = array_at(hooks, "poststop", "hooks.poststop")?;
    let path = hook.display().to_string();
    poststop.retain(|h| h.get("path").and_then(Value::as_str) != Some(path.as_str()));
    poststop.push(json!({
        "path": path,
        "args": ["tessera-hook", "poststop", "--alloc-dir", alloc_dir.display().to_string()],
        "env": [tessera_region::cdi::HOOK_ENV],
    }));
    Ok(())
}

/// Whether config.json already gives the container `node`: the same node in `linux.devices`, and
/// read and write allowed by `linux.resources.devices` (rules in order, a later match overrides an
/// earlier one, as runc applies them). A CDI-capable runtime has put such nodes there itself, so the
/// hook need not make them, nor touch the device cgroup (which it cannot do on cgroup v2).
pub fn grants_device(config: &Value, node: &crate::plan::NodeEdit) -> bool {
    let path = node.path.to_string_lossy();
    let listed = config.pointer("/linux/devices").and_then(Value::as_array).is_some_and(|ds| {
        ds.iter().any(|d| {
            d.get("path").and_then(Value::as_str) == Some(&*path)
                && d.get("major").and_then(Value::as_i64) == Some(node.major as i64)
                && d.get("minor").and_then(Value::as_i64) == Some(node.minor as i64)
        })
    });
    if !listed {
        return false;
    }
    let Some(rules) = config.pointer("/linux/resources/devices").and_then(Value::as_array) else {
        return false;
    };
    let number_matches = |v: Option<&Value>, want: u32| match v {
        None | Some(Value::Null) => true,
        Some(n) => n.as_i64().is_some_and(|n| n == -1 || n == want as i64),
    };
    let (mut read, mut write) = (false, false);
    for r in rules {
        let kind_matches = matches!(r.get("type").and_then(Value::as_str), None | Some("a") | Some("c"));
        if !kind_matches || !number_matches(r.get("major"), node.major) || !number_matches(r.get("minor"), node.minor) {
            continue;
        }
        let allow = r.get("allow").and_then(Value::as_bool).unwrap_or(false);
        let access = r.get("access").and_then(Value::as_str).unwrap_or("rwm");
        if access.contains('r') {
            read = allow;
        }
        if access.contains('w') {
            write = allow;
        }
    }
    read && write
}

/// Applies a plan to config.json (the wrapper's way): device nodes, device-cgroup rules, bind
/// mounts, environment. Entries already there are kept; a clash is an error naming the field.
pub fn apply_to_config(config: &mut Value, plan: &Plan) -> Result<(), InjectError> {
    // Check everything first, then change: an error leaves `config` as it was.
    let mut next = config.clone();
    {
        let linux = object_at(&mut next, "linux", "")?;
        let devices = array_at(linux, "devices", "linux.devices")?;
        for n in &plan.device_nodes {
            let path = n.path.display().to_string();
            match devices.iter().find(|d| d.get("path").and_then(Value::as_str) == Some(&path)) {
                Some(d) => {
                    let same = d.get("major").and_then(Value::as_u64) == Some(n.major as u64)
                        && d.get("minor").and_then(Value::as_u64) == Some(n.minor as u64);
                    if !same {
                        return Err(bad("linux.devices", format!("{path} is already given with other numbers")));
                    }
                }
                None => devices.push(json!({
                    "path": path, "type": "c", "major": n.major, "minor": n.minor,
                    "fileMode": 0o666, "uid": 0, "gid": 0
                })),
            }
        }
        let resources = object_at(&mut next["linux"], "resources", "linux")?;
        let rules = array_at(resources, "devices", "linux.resources.devices")?;
        for n in &plan.device_nodes {
            let rule = json!({"allow": true, "type": "c", "major": n.major, "minor": n.minor, "access": "rwm"});
            if !rules.contains(&rule) {
                rules.push(rule);
            }
        }
    }
    {
        let root = next.as_object_mut().ok_or_else(|| bad("", "expected an object"))?;
        let mounts = array_at(root, "mounts", "mounts")?;
        for m in &plan.mounts {
            let dest = m.container_path.display().to_string();
            let src = m.host_path.display().to_string();
            match mounts.iter().find(|x| x.get("destination").and_then(Value::as_str) == Some(&dest)) {
                Some(x) if x.get("source").and_then(Value::as_str) == Some(&src) => {}
                Some(_) => return Err(bad("mounts", format!("{dest} is already mounted from elsewhere"))),
                None => {
                    let rw = if m.read_only { "ro" } else { "rw" };
                    // Not recursive: the allocation directory's own mounts (its region's tmpfs)
                    // must not come along read-write under a read-only directory; the region
                    // comes as a mount of its own.
                    mounts.push(json!({
                        "destination": dest, "type": "bind", "source": src,
                        "options": ["bind", rw, "nosuid", "nodev"]
                    }));
                }
            }
        }
    }
    {
        let process = object_at(&mut next, "process", "")?;
        let env = array_at(process, "env", "process.env")?;
        for (k, v) in &plan.env {
            let prefix = format!("{k}=");
            env.retain(|e| !e.as_str().is_some_and(|s| s.starts_with(&prefix)));
            env.push(Value::String(format!("{k}={v}")));
        }
    }
    *config = next;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{MountEdit, NodeEdit};

    #[test]
    fn a_file_is_read_whole_up_to_the_limit_and_refused_beyond() {
        let dir = tempfile::tempdir().unwrap();
        let small = dir.path().join("small.json");
        let bytes: Vec<u8> = (0..70_000u32).map(|i| b'a' + (i % 26) as u8).collect();
        std::fs::write(&small, &bytes).unwrap();
        assert_eq!(read_limited(&small).unwrap(), bytes);
        std::fs::write(&small, b"").unwrap();
        assert_eq!(read_limited(&small).unwrap(), b"");
        let big = dir.path().join("big.json");
        std::fs::File::create(&big).unwrap().set_len(MAX_JSON + 1).unwrap();
        assert_eq!(read_limited(&big).unwrap_err().kind(), std::io::ErrorKind::InvalidData);
        std::fs::File::create(&big).unwrap().set_len(MAX_JSON).unwrap();
        assert_eq!(read_limited(&big).unwrap().len() as u64, MAX_JSON);
        // A file the kernel makes up as it is read (its stat says 0 bytes) is read whole too.
        assert!(!read_limited(Path::new("/proc/self/mountinfo")).unwrap().is_empty());
        assert_eq!(
            crate::sys::read_proc(Path::new("/proc/self/cgroup")).unwrap(),
            std::fs::read("/proc/self/cgroup").unwrap()
        );
    }

    #[test]
    fn a_device_is_granted_only_when_listed_and_allowed_read_write() {
        let node = &plan().device_nodes[0];
        let dev = json!({"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0});
        let deny_all = json!({"allow": false, "access": "rwm"});
        let allow = json!({"allow": true, "type": "c", "major": 195, "minor": 0, "access": "rwm"});
        let cfg =
            |devices: Value, rules: Value| json!({"linux": {"devices": devices, "resources": {"devices": rules}}});
        assert!(grants_device(&cfg(json!([dev.clone()]), json!([deny_all.clone(), allow.clone()])), node));
        // Wildcards, as CDI runtimes and privileged containers write them.
        let any = json!({"allow": true, "type": "c", "major": 195, "minor": -1, "access": "rw"});
        assert!(grants_device(&cfg(json!([dev.clone()]), json!([deny_all.clone(), any])), node));
        // Not listed: the node is not made in the container.
        assert!(!grants_device(&cfg(json!([]), json!([deny_all.clone(), allow.clone()])), node));
        // Listed with other numbers.
        let other = json!({"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 7});
        assert!(!grants_device(&cfg(json!([other]), json!([allow.clone()])), node));
        // Denied after being allowed (a later rule wins), or allowed read-only.
        assert!(!grants_device(&cfg(json!([dev.clone()]), json!([allow.clone(), deny_all.clone()])), node));
        let read_only = json!({"allow": true, "type": "c", "major": 195, "minor": 0, "access": "r"});
        assert!(!grants_device(&cfg(json!([dev.clone()]), json!([deny_all.clone(), read_only])), node));
        // No rules at all: nothing says it is allowed.
        assert!(!grants_device(&json!({"linux": {"devices": [dev]}}), node));
    }

    fn plan() -> Plan {
        Plan {
            device_nodes: vec![NodeEdit {
                path: "/dev/nvidia0".into(),
                host_path: "/dev/nvidia0".into(),
                major: 195,
                minor: 0,
            }],
            mounts: vec![MountEdit {
                host_path: "/h/lib".into(),
                container_path: "/usr/lib/x".into(),
                read_only: true,
            }],
            env: vec![("TESSERA_VISIBLE_DEVICES".into(), "GPU-a".into())],
            ..Plan::default()
        }
    }

    #[test]
    fn edits_keep_unknown_fields_and_are_idempotent() {
        let mut c = json!({"ociVersion": "1.0.2", "x-vendor": {"k": 1}, "process": {"env": ["A=1", "TESSERA_VISIBLE_DEVICES=0"]}, "linux": {"resources": {"devices": [{"allow": false, "access": "rwm"}]}}});
        apply_to_config(&mut c, &plan()).unwrap();
        let once = c.clone();
        apply_to_config(&mut c, &plan()).unwrap();
        assert_eq!(c, once);
        assert_eq!(c["x-vendor"]["k"], 1);
        assert_eq!(c["process"]["env"], json!(["A=1", "TESSERA_VISIBLE_DEVICES=GPU-a"]));
        assert_eq!(c["linux"]["devices"][0]["major"], 195);
        assert_eq!(
            c["linux"]["resources"]["devices"][1],
            json!({"allow": true, "type": "c", "major": 195, "minor": 0, "access": "rwm"})
        );
        assert_eq!(c["mounts"][0]["options"], json!(["bind", "ro", "nosuid", "nodev"]));
    }

    #[test]
    fn malformed_fields_are_named_and_leave_config_alone() {
        for (c, want) in [
            (json!({"process": {"env": "A=1"}}), "config.json: process.env: expected an array"),
            (json!({"linux": {"devices": {}}}), "config.json: linux.devices: expected an array"),
            (
                json!({"mounts": [{"destination": "/usr/lib/x", "source": "/other"}]}),
                "config.json: mounts: /usr/lib/x is already mounted from elsewhere",
            ),
            (
                json!({"linux": {"devices": [{"path": "/dev/nvidia0", "major": 1, "minor": 3}]}}),
                "config.json: linux.devices: /dev/nvidia0 is already given",
            ),
        ] {
            let mut edited = c.clone();
            let e = apply_to_config(&mut edited, &plan()).unwrap_err().0;
            assert!(e.starts_with(want), "{e}");
            assert_eq!(edited, c);
        }
        let e = container_info(&json!({"process": {"env": [1]}}), &BTreeMap::new()).unwrap_err().0;
        assert_eq!(e, "config.json: process.env[0]: expected a string");
        let e = container_info(&json!({"annotations": {"a": 1}}), &BTreeMap::new()).unwrap_err().0;
        assert_eq!(e, "config.json: annotations.a: expected a string");
        assert_eq!(root_path(&json!({"root": {}}), Path::new("/b")).unwrap_err().0, "config.json: root.path: missing");
    }

    #[test]
    fn state() {
        let s = parse_state(
            br#"{"ociVersion":"1.0.2","id":"c1","status":"creating","pid":42,"bundle":"/b","annotations":{"a":"b"}}"#,
        )
        .unwrap();
        assert_eq!((s.id.as_str(), s.pid, s.bundle.as_path()), ("c1", 42, Path::new("/b")));
        for (t, want) in [
            (&br#"{"id":"c","bundle":"/b"}"#[..], "state: pid: missing"),
            (br#"{"id":"c","pid":0,"bundle":"/b"}"#, "state: pid: not a process id"),
            (br#"{"id":"c","pid":1,"bundle":"b"}"#, "state: bundle: not an absolute path"),
            (br#"{"#, "state: not valid JSON"),
        ] {
            let e = parse_state(t).unwrap_err().0;
            assert!(e.starts_with(want), "{e}");
        }
    }
}
