//! A small checker of the text format, for tests: what Prometheus would refuse, it refuses.

use std::collections::{BTreeMap, HashMap, HashSet};

/// One sample: name, labels, value.
pub type Sample = (String, BTreeMap<String, String>, f64);

/// Parses `text`; panics naming the line that breaks the format: every sample line
/// `name{labels} value` with valid names and escapes, a finite value, HELP and TYPE exactly once
/// per name and before its samples, no series twice.
pub fn parse(text: &str) -> Vec<Sample> {
    let mut help = HashSet::new();
    let mut types: HashMap<String, String> = HashMap::new();
    let mut series = HashSet::new();
    let mut samples = Vec::new();
    assert!(text.ends_with('\n'), "the text ends with a line feed");
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, _) = rest.split_once(' ').unwrap_or((rest, ""));
            assert!(valid_name(name), "bad name in {line:?}");
            assert!(help.insert(name.to_string()), "HELP twice for {name}");
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or_else(|| panic!("bad TYPE {line:?}"));
            assert!(["gauge", "counter"].contains(&kind), "bad type in {line:?}");
            assert!(types.insert(name.to_string(), kind.to_string()).is_none(), "TYPE twice for {name}");
            continue;
        }
        assert!(!line.starts_with('#') && !line.is_empty(), "unexpected line {line:?}");
        let (name, labels, rest) = match line.find('{') {
            Some(i) => {
                let (labels, rest) = parse_labels(&line[i + 1..]).unwrap_or_else(|e| panic!("{e}: {line:?}"));
                (&line[..i], labels, rest)
            }
            None => {
                let (name, rest) = line.split_once(' ').unwrap_or_else(|| panic!("no value: {line:?}"));
                (name, BTreeMap::new(), rest)
            }
        };
        assert!(valid_name(name), "bad name in {line:?}");
        assert!(help.contains(name) && types.contains_key(name), "sample before HELP/TYPE: {line:?}");
        if types[name] == "counter" {
            // dcgm-exporter's counters end in _TOTAL.
            assert!(name.to_ascii_lowercase().ends_with("_total"), "counter without _total: {name}");
        }
        let value: f64 = rest.trim_start_matches(' ').parse().unwrap_or_else(|_| panic!("bad value: {line:?}"));
        assert!(value.is_finite(), "value not finite: {line:?}");
        assert!(series.insert((name.to_string(), labels.clone())), "series twice: {line:?}");
        samples.push((name.to_string(), labels, value));
    }
    for name in &help {
        assert!(types.contains_key(name), "HELP without TYPE: {name}");
    }
    samples
}

fn valid_name(n: &str) -> bool {
    let mut chars = n.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// Parses `k="v",...}` and returns the labels and what follows the `}`.
fn parse_labels(s: &str) -> Result<(BTreeMap<String, String>, &str), String> {
    let mut labels = BTreeMap::new();
    let mut rest = s;
    loop {
        if let Some(r) = rest.strip_prefix('}') {
            return Ok((labels, r));
        }
        let eq = rest.find('=').ok_or("label without =")?;
        let key = &rest[..eq];
        if !valid_name(key) || key.contains(':') {
            return Err(format!("bad label name {key:?}"));
        }
        let mut chars = rest[eq + 1..].strip_prefix('"').ok_or("label value not quoted")?.char_indices();
        let mut value = String::new();
        let end = loop {
            match chars.next().ok_or("unterminated label value")? {
                (_, '\\') => match chars.next().ok_or("dangling escape")?.1 {
                    '\\' => value.push('\\'),
                    '"' => value.push('"'),
                    'n' => value.push('\n'),
                    c => return Err(format!("bad escape \\{c}")),
                },
                (_, '\n') => return Err("raw line feed in label value".into()),
                (i, '"') => break i,
                (_, c) => value.push(c),
            }
        };
        if labels.insert(key.to_string(), value).is_some() {
            return Err(format!("label {key} twice"));
        }
        rest = &rest[eq + 1 + 1 + end + 1..];
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
}
