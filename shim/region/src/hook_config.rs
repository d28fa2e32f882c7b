//! The hook's and the wrapper's own configuration: a small TOML file, default
//! `/etc/tessera/hook.toml`. A missing file at the default path means the defaults; every error
//! names the key.
//!
//! ```toml
//! cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
//! runtime_dir = "/run/tessera"
//! driver_root = "/"
//! dev_root = "/dev"
//! runtime = "runc"                      # the wrapper's real runtime: a name on PATH or a path
//! require_allocation = true
//! shim_path = "/usr/local/lib/tessera/libtessera.so"
//! ```

use std::path::{Path, PathBuf};

use crate::paths;

/// Where the configuration is read from when nothing else is said.
pub const DEFAULT_PATH: &str = crate::paths::HOOK_CONFIG;
/// The wrapper's way to name another configuration file (the hook takes `--config`).
pub const ENV_CONFIG: &str = "TESSERA_HOOK_CONFIG";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookConfig {
    /// Directories holding CDI specs; the first holding a `tessera.io` spec of a class wins for it.
    pub cdi_spec_dirs: Vec<PathBuf>,
    /// The daemon's runtime directory: `alloc/<id>/{limits,region}` live under it.
    pub runtime_dir: PathBuf,
    /// Root of the host's driver files (tests: a fake driver root).
    pub driver_root: PathBuf,
    /// Host directory of the device nodes (tests: a temporary directory with mknod'ed nodes).
    pub dev_root: PathBuf,
    /// The real OCI runtime the wrapper execs: a name looked up on PATH, or a path.
    pub runtime: String,
    /// Refuse devices to a container that names no allocation (false only on a standalone host).
    pub require_allocation: bool,
    /// Host path of libtessera.so; none: no shim and no /etc/ld.so.preload.
    pub shim_path: Option<PathBuf>,
}

impl Default for HookConfig {
    fn default() -> HookConfig {
        HookConfig {
            cdi_spec_dirs: paths::CDI_SPEC_DIRS.iter().map(PathBuf::from).collect(),
            runtime_dir: PathBuf::from(paths::RUNTIME_DIR),
            driver_root: PathBuf::from("/"),
            dev_root: PathBuf::from("/dev"),
            runtime: "runc".into(),
            require_allocation: true,
            shim_path: Some(PathBuf::from(paths::SHIM)),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: not valid TOML: {reason}", path.display())]
    Syntax { path: PathBuf, reason: String },
    #[error("{}: {key}: {reason}", path.display())]
    Invalid { path: PathBuf, key: String, reason: String },
}

/// The wrapper's configuration file: `$TESSERA_HOOK_CONFIG`, else [`DEFAULT_PATH`] when it
/// exists, else the one tesserad writes for its specs (`/run/tessera/hook.toml`) when that exists
/// (a containerd runtime handler cannot give the wrapper an argument or an environment, and a
/// node set up by `tessera install` has no file of its own), else [`DEFAULT_PATH`] (the defaults).
pub fn wrapper_config_path(env: Option<std::ffi::OsString>, default: &Path, generated: &Path) -> PathBuf {
    match env {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ if !default.exists() && generated.exists() => generated.to_path_buf(),
        _ => default.to_path_buf(),
    }
}

impl HookConfig {
    /// Reads `path`; a missing file at [`DEFAULT_PATH`] gives the defaults, elsewhere it is an error.
    pub fn load(path: &Path) -> Result<HookConfig, ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => HookConfig::parse(&text).map_err(|e| match e {
                ConfigError::Syntax { reason, .. } => ConfigError::Syntax { path: path.into(), reason },
                ConfigError::Invalid { key, reason, .. } => ConfigError::Invalid { path: path.into(), key, reason },
                e => e,
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && path == Path::new(DEFAULT_PATH) => {
                Ok(HookConfig::default())
            }
            Err(source) => Err(ConfigError::Io { path: path.into(), source }),
        }
    }

    /// Parses the text of a configuration file (errors carry an empty path; [`HookConfig::load`] fills it).
    pub fn parse(text: &str) -> Result<HookConfig, ConfigError> {
        let table: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| ConfigError::Syntax { path: PathBuf::new(), reason: one_line(&e) })?;
        let bad = |key: &str, reason: String| ConfigError::Invalid { path: PathBuf::new(), key: key.into(), reason };
        let mut c = HookConfig::default();
        for (key, value) in &table {
            let string = || match value {
                toml::Value::String(s) if !s.trim().is_empty() => Ok(s.clone()),
                toml::Value::String(_) => Err(bad(key, "is empty".into())),
                v => Err(bad(key, format!("expected a string, found {}", v.type_str()))),
            };
            let abs_path = || {
                let s = string()?;
                if !s.starts_with('/') {
                    return Err(bad(key, format!("{s:?} is not an absolute path")));
                }
                Ok(PathBuf::from(s))
            };
            match key.as_str() {
                "cdi_spec_dirs" => {
                    let toml::Value::Array(items) = value else {
                        return Err(bad(key, format!("expected an array of paths, found {}", value.type_str())));
                    };
                    c.cdi_spec_dirs = Vec::new();
                    for (i, item) in items.iter().enumerate() {
                        let k = format!("cdi_spec_dirs[{i}]");
                        match item {
                            toml::Value::String(s) if s.starts_with('/') => c.cdi_spec_dirs.push(PathBuf::from(s)),
                            toml::Value::String(s) => return Err(bad(&k, format!("{s:?} is not an absolute path"))),
                            v => return Err(bad(&k, format!("expected a string, found {}", v.type_str()))),
                        }
                    }
                }
                "runtime_dir" => c.runtime_dir = abs_path()?,
                "driver_root" => c.driver_root = abs_path()?,
                "dev_root" => c.dev_root = abs_path()?,
                "runtime" => c.runtime = string()?,
                "shim_path" => match value {
                    toml::Value::String(s) if s.is_empty() => c.shim_path = None,
                    _ => c.shim_path = Some(abs_path()?),
                },
                "require_allocation" => match value {
                    toml::Value::Boolean(b) => c.require_allocation = *b,
                    v => return Err(bad(key, format!("expected true or false, found {}", v.type_str()))),
                },
                _ => return Err(bad(key, "unknown key".into())),
            }
        }
        Ok(c)
    }

    /// The configuration as a file [`HookConfig::parse`] reads back unchanged (the daemon writes
    /// the one its CDI specs name).
    pub fn render(&self) -> String {
        let quote = |p: &Path| toml::Value::String(p.display().to_string()).to_string();
        let dirs: Vec<String> = self.cdi_spec_dirs.iter().map(|d| quote(d)).collect();
        format!(
            "cdi_spec_dirs = [{}]\nruntime_dir = {}\ndriver_root = {}\ndev_root = {}\nruntime = {}\n\
             require_allocation = {}\nshim_path = {}\n",
            dirs.join(", "),
            quote(&self.runtime_dir),
            quote(&self.driver_root),
            quote(&self.dev_root),
            toml::Value::String(self.runtime.clone()),
            self.require_allocation,
            self.shim_path.as_deref().map_or_else(|| "\"\"".to_string(), quote),
        )
    }

    /// The driver discovery settings this configuration names.
    pub fn driver(&self) -> crate::driver::DriverConfig {
        crate::driver::DriverConfig {
            root: self.driver_root.clone(),
            dev_root: self.dev_root.clone(),
            ..crate::driver::DriverConfig::default()
        }
    }
}

fn one_line(e: &toml::de::Error) -> String {
    e.to_string().split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        HookConfig::parse(text).unwrap_err().to_string()
    }

    #[test]
    fn defaults_and_full_file() {
        assert_eq!(HookConfig::parse("").unwrap(), HookConfig::default());
        let c = HookConfig::parse(
            r#"
cdi_spec_dirs = ["/tmp/cdi"]
runtime_dir = "/tmp/run"
driver_root = "/tmp/driver"
dev_root = "/tmp/dev"
runtime = "/usr/sbin/runc"
require_allocation = false
shim_path = ""
"#,
        )
        .unwrap();
        assert_eq!(c.cdi_spec_dirs, vec![PathBuf::from("/tmp/cdi")]);
        assert_eq!(c.runtime_dir, Path::new("/tmp/run"));
        assert_eq!(c.driver().dev_root, Path::new("/tmp/dev"));
        assert_eq!(c.runtime, "/usr/sbin/runc");
        assert!(!c.require_allocation);
        assert_eq!(c.shim_path, None);
    }

    #[test]
    fn the_wrapper_falls_back_to_the_daemons_file_only_when_the_operator_wrote_none() {
        let dir = tempfile::tempdir().unwrap();
        let (default, generated) = (dir.path().join("etc-hook.toml"), dir.path().join("run-hook.toml"));
        let pick = |env: Option<&str>| wrapper_config_path(env.map(Into::into), &default, &generated);
        assert_eq!(pick(None), default, "neither exists: the defaults");
        std::fs::write(&generated, "").unwrap();
        assert_eq!(pick(None), generated);
        assert_eq!(pick(Some("")), generated, "an empty variable names nothing");
        std::fs::write(&default, "").unwrap();
        assert_eq!(pick(None), default, "the operator's file wins");
        assert_eq!(pick(Some("/x.toml")), Path::new("/x.toml"));
    }

    #[test]
    fn render_reads_back_unchanged() {
        let mut c = HookConfig::default();
        assert_eq!(HookConfig::parse(&c.render()).unwrap(), c);
        c.cdi_spec_dirs = vec![PathBuf::from("/tmp/a \"quoted\" dir"), PathBuf::from("/x")];
        c.driver_root = PathBuf::from("/run/nvidia/driver");
        c.shim_path = None;
        c.require_allocation = false;
        assert_eq!(HookConfig::parse(&c.render()).unwrap(), c);
    }

    #[test]
    fn errors_name_the_key() {
        for (text, want) in [
            ("colour = 1", "colour: unknown key"),
            ("runtime_dir = 3", "runtime_dir: expected a string, found integer"),
            ("runtime_dir = \"run\"", "runtime_dir: \"run\" is not an absolute path"),
            ("require_allocation = \"no\"", "require_allocation: expected true or false, found string"),
            ("cdi_spec_dirs = \"/etc/cdi\"", "cdi_spec_dirs: expected an array of paths, found string"),
            ("cdi_spec_dirs = [\"/a\", \"b\"]", "cdi_spec_dirs[1]: \"b\" is not an absolute path"),
            ("runtime = \"\"", "runtime: is empty"),
        ] {
            assert!(err(text).ends_with(want), "{text}: {}", err(text));
        }
        assert!(err("runtime = ").contains("not valid TOML"), "{}", err("runtime = "));
    }

    #[test]
    fn load_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("hook.toml");
        std::fs::write(&p, "dev_root = 1").unwrap();
        let e = HookConfig::load(&p).unwrap_err().to_string();
        assert_eq!(e, format!("{}: dev_root: expected a string, found integer", p.display()));
        let missing = dir.path().join("nope.toml");
        assert!(HookConfig::load(&missing).unwrap_err().to_string().starts_with(&missing.display().to_string()));
    }
}
