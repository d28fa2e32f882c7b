//! containerd's `config.toml`, edited in place: a `tessera` runtime handler (the wrapper, for
//! containerd 1.6, which has no CDI) and CDI turned on (containerd 1.7; ignored by 1.6; on by
//! default in 2.x).
//!
//! Not an `imports` drop-in: containerd 1.6 and 1.7 replace a plugin's whole table with an
//! imported one, so a drop-in naming the CRI plugin would drop the host's own CRI settings
//! (its runc options, sandbox image, …). Instead the added lines sit between marker comments,
//! and uninstalling removes exactly those lines, giving back the file as it was. Declaring any
//! runtime replaces containerd's built-in runtime table, so a file that declares no `runc`
//! runtime gets containerd's default one declared with ours.

/// The first line of every block this module adds.
pub const BEGIN: &str = "# BEGIN tessera install (`tessera uninstall` removes this block)";
/// The last line of every block this module adds.
pub const END: &str = "# END tessera install";

/// The name of the runtime handler (a RuntimeClass's `handler`).
pub const HANDLER: &str = "tessera";

/// `text` without the blocks [`edit`] added.
pub fn strip(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut inside = false;
    for line in text.split_inclusive('\n') {
        match line.trim_end() {
            BEGIN => inside = true,
            END if inside => inside = false,
            _ if !inside => out.push_str(line),
            _ => {}
        }
    }
    out
}

/// The configuration with Tessera's blocks: `original` is the file's text (`None`: no file).
/// Refuses what it cannot edit safely, saying why.
pub fn edit(original: Option<&str>, wrapper: &str, cdi_dirs: &[&str]) -> Result<String, String> {
    let text = original.map(strip).unwrap_or_default();
    let version = top_level_version(&text);
    let (cri, runtimes) = match (version, text.trim().is_empty()) {
        (Some(2), _) | (None, true) => {
            ("plugins.\"io.containerd.grpc.v1.cri\"", "plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes")
        }
        (Some(3), _) => {
            ("plugins.\"io.containerd.cri.v1.runtime\"", "plugins.\"io.containerd.cri.v1.runtime\".containerd.runtimes")
        }
        (v, _) => {
            return Err(format!(
                "config version {} is not supported; migrate it to version 2 or 3 first (`containerd config migrate`)",
                v.map_or_else(|| "1 (no `version` key)".to_string(), |v| v.to_string())
            ));
        }
    };
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    if text.trim().is_empty() {
        lines = vec!["version = 2".into()];
    }
    if find_header(&lines, &format!("{runtimes}.{HANDLER}")).is_some() {
        return Err(format!("it already declares a `{HANDLER}` runtime that tessera install did not write; remove it"));
    }
    // CDI on (containerd 1.7; 2.x has it on by default, 1.6 ignores the keys): inside the CRI
    // plugin's table when the file has one, keys it already sets left as they are.
    if version != Some(3) {
        let keys = [
            ("enable_cdi", "true".to_string()),
            (
                "cdi_spec_dirs",
                format!("[{}]", cdi_dirs.iter().map(|d| format!("{d:?}")).collect::<Vec<_>>().join(", ")),
            ),
        ];
        match find_header(&lines, cri) {
            Some(at) => {
                let end = lines[at + 1..].iter().position(|l| is_header(l)).map_or(lines.len(), |i| at + 1 + i);
                let set = |k: &str| lines[at + 1..end].iter().any(|l| l.trim_start().starts_with(k));
                let add: Vec<String> =
                    keys.iter().filter(|(k, _)| !set(k)).map(|(k, v)| format!("  {k} = {v}")).collect();
                if !add.is_empty() {
                    let block = [vec![BEGIN.to_string()], add, vec![END.to_string()]].concat();
                    lines.splice(at + 1..at + 1, block);
                }
            }
            None => {
                lines.push(BEGIN.into());
                lines.push(format!("[{cri}]"));
                lines.extend(keys.iter().map(|(k, v)| format!("  {k} = {v}")));
                lines.push(END.into());
            }
        }
    }
    lines.push(BEGIN.into());
    if find_header(&lines, &format!("{runtimes}.runc")).is_none() {
        lines.push(format!("[{runtimes}.runc]"));
        lines.push("  runtime_type = \"io.containerd.runc.v2\"".into());
    }
    lines.push(format!("[{runtimes}.{HANDLER}]"));
    lines.push("  runtime_type = \"io.containerd.runc.v2\"".into());
    lines.push(format!("[{runtimes}.{HANDLER}.options]"));
    lines.push(format!("  BinaryName = {wrapper:?}"));
    lines.push(END.into());
    let out = lines.join("\n") + "\n";
    out.parse::<toml::Table>().map_err(|e| {
        format!("the edited file would not be valid TOML ({}); add the runtime by hand (docs/install.md)", e.message())
    })?;
    Ok(out)
}

/// `version = N` before the first table.
fn top_level_version(text: &str) -> Option<i64> {
    for line in text.lines() {
        let l = line.trim();
        if is_header(l) {
            return None;
        }
        if let Some((k, v)) = l.split_once('=')
            && k.trim() == "version"
        {
            return v.split('#').next()?.trim().parse().ok();
        }
    }
    None
}

fn is_header(line: &str) -> bool {
    line.trim_start().starts_with('[')
}

/// The line of `[name]`, compared without spaces and with either kind of quote.
fn find_header(lines: &[String], name: &str) -> Option<usize> {
    let norm =
        |s: &str| s.chars().filter(|c| !c.is_whitespace()).map(|c| if c == '\'' { '"' } else { c }).collect::<String>();
    let want = norm(&format!("[{name}]"));
    lines.iter().position(|l| {
        let l = l.split('#').next().unwrap_or("");
        !l.trim_start().starts_with("[[") && norm(l) == want
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIRS: &[&str] = &["/etc/cdi", "/var/run/cdi"];
    const WRAPPER: &str = "/usr/local/bin/tessera-runtime";

    #[test]
    fn no_file_gets_cdi_runc_and_the_handler() {
        let out = edit(None, WRAPPER, DIRS).unwrap();
        let t: toml::Table = out.parse().unwrap();
        let cri = &t["plugins"]["io.containerd.grpc.v1.cri"];
        assert_eq!(cri["enable_cdi"].as_bool(), Some(true));
        assert_eq!(cri["containerd"]["runtimes"]["runc"]["runtime_type"].as_str(), Some("io.containerd.runc.v2"));
        assert_eq!(cri["containerd"]["runtimes"]["tessera"]["options"]["BinaryName"].as_str(), Some(WRAPPER));
        assert_eq!(strip(&out).trim(), "version = 2");
    }

    #[test]
    fn a_hosts_settings_are_kept_and_uninstall_gives_back_every_byte() {
        let host = "# host config\nversion = 2\n\n[plugins]\n  [plugins.'io.containerd.grpc.v1.cri']\n    sandbox_image = \"pause:3.9\"\n    enable_cdi = false\n    [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\n      runtime_type = \"io.containerd.runc.v2\"\n      [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]\n        SystemdCgroup = true\n";
        let out = edit(Some(host), WRAPPER, DIRS).unwrap();
        let t: toml::Table = out.parse().unwrap();
        let cri = &t["plugins"]["io.containerd.grpc.v1.cri"];
        assert_eq!(cri["sandbox_image"].as_str(), Some("pause:3.9"));
        assert_eq!(cri["enable_cdi"].as_bool(), Some(false), "the operator's choice stays");
        assert_eq!(cri["cdi_spec_dirs"].as_array().map(Vec::len), Some(2));
        assert_eq!(cri["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"].as_bool(), Some(true));
        assert!(cri["containerd"]["runtimes"].get("tessera").is_some());
        assert_eq!(strip(&out), host);
        // Again (an upgrade): the same file, not a second block.
        assert_eq!(edit(Some(&out), WRAPPER, DIRS).unwrap(), out);
    }

    #[test]
    fn refusals_say_why() {
        let e = edit(Some("[plugins.cri]\n  x = 1\n"), WRAPPER, DIRS).unwrap_err();
        assert!(e.contains("version 1") && e.contains("containerd config migrate"), "{e}");
        let theirs = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.tessera]\n  runtime_type = \"x\"\n";
        assert!(edit(Some(theirs), WRAPPER, DIRS).unwrap_err().contains("already declares"));
        // Dotted keys that clash with the added table: refused, the file unchanged.
        let dotted =
            "version = 2\nplugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.tessera.runtime_type = \"x\"\n";
        assert!(edit(Some(dotted), WRAPPER, DIRS).unwrap_err().contains("not be valid TOML"));
    }

    #[test]
    fn version_3_uses_containerd_2s_names() {
        let out = edit(Some("version = 3\n"), WRAPPER, DIRS).unwrap();
        let t: toml::Table = out.parse().unwrap();
        let rt = &t["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"];
        assert_eq!(rt["tessera"]["options"]["BinaryName"].as_str(), Some(WRAPPER));
    }
}
