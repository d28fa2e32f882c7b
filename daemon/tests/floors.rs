//! The daemon's floors (docs/architecture.md, "The daemon's floors"): every module of
//! `daemon/src` stands on one floor, and an import never runs from a lower floor to a higher
//! one. Read from the code itself: every `daemon/src` file the library compiles (tests left
//! out) is parsed, and each `crate::`, `super::` and `self::` path in it (`use` lines, paths in
//! code, paths inside macro calls) is an edge from its module to the module it names.
//!
//! Checked:
//! - every module of `lib.rs` has a floor in [`FLOORS`], and every entry there is a module;
//! - no edge runs up a floor, and no face imports another face;
//! - no import circle: not between the crate's modules, and not between the files of one folder
//!   (a folder's files may use their `mod.rs` and be used by it; among themselves, no circle);
//! - every edge in [`NOT_YET`] is still there (the list only shrinks: remove an entry once its
//!   edge is gone).
//!
//! A failure names the file, the line, the path and the two floors, and says how to mend it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use proc_macro2::{TokenStream, TokenTree};
use syn::visit::Visit;

/// The floors, lowest first. A module may import its own floor and those below it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Floor {
    /// Helpers that know nothing of GPUs: owner-only sockets, client input quoted in errors,
    /// short blocking work inside a request handler.
    Base,
    /// The node model: the configuration, the inventory (and the one NVML session it is read
    /// through), layout plans, what is offered, health with its reason.
    Core,
    /// What lasts: the allocation journal and records, the allocation directories, the event
    /// log, the regions' usage and traces, the CDI specs on disk.
    State,
    /// The one place that changes the node: allocate, release, set limits, apply layouts,
    /// reconcile, health and enforcement decisions, leases.
    Control,
    /// The ways in and out: the kubelet device plugin, DRA, the node API, metrics/OTLP, the
    /// Kubernetes writer, the installer. A face reads core's published view and calls control;
    /// it never imports another face.
    Faces,
}

use Floor::*;

/// Every module of `daemon/src/lib.rs` and its floor (the binaries in `src/bin` stand above
/// them all).
const FLOORS: &[(&str, Floor)] = &[
    ("blocking", Base),
    ("client_input", Base),
    ("socket", Base),
    ("procfs", Base),
    ("kube_client", Base),
    ("config", Core),
    ("discovery", Core),
    ("device_health", Core),
    ("view", Core),
    ("holdings", Core),
    ("partition", Core),
    ("resources", Core),
    ("state", State),
    ("events", State),
    ("usage", State),
    ("trace", State),
    ("park", State),
    ("cdi", State),
    ("node", Control),
    ("allocator", Control),
    ("carve", Control),
    ("enforcement", Control),
    ("health", Control),
    ("lease", Control),
    ("ledger", Control),
    ("podresources", Control),
    ("kubelet", Faces),
    ("dra", Faces),
    ("api", Faces),
    ("telemetry", Faces),
    ("kubernetes", Faces),
    ("install", Faces),
];

/// Edges that break the rules today and are being removed (issue 32), as (from module, to
/// module, why it is still there). The test fails once one is gone: then strike its line.
const NOT_YET: &[(&str, &str, &str)] = &[];

#[test]
fn every_module_has_a_floor() {
    let tree = Tree::read();
    let declared: BTreeSet<&str> = tree.top_modules.iter().map(String::as_str).collect();
    let floored: BTreeSet<&str> = FLOORS.iter().map(|(m, _)| *m).collect();
    let mut problems = Vec::new();
    for m in declared.difference(&floored) {
        problems.push(format!(
            "daemon/src/lib.rs declares `{m}`, which has no floor: add it to FLOORS in {} (and to the floors \
             table in docs/architecture.md) on the lowest floor whose modules it imports from",
            file!()
        ));
    }
    for m in floored.difference(&declared) {
        problems.push(format!("FLOORS names `{m}`, which daemon/src/lib.rs does not declare: strike it"));
    }
    assert!(problems.is_empty(), "\n{}\n", problems.join("\n"));
}

#[test]
fn no_import_runs_up_a_floor_or_across_faces() {
    let problems = RULES.offending_edges(Tree::read());
    assert!(problems.is_empty(), "\n{}\n", problems.join("\n"));
}

#[test]
fn no_import_circle() {
    let problems = RULES.circles(Tree::read());
    assert!(problems.is_empty(), "\n{}\n", problems.join("\n"));
}

#[test]
fn every_edge_not_yet_broken_is_still_there() {
    let tree = Tree::read();
    let there: BTreeSet<(&str, &str)> = tree.edges.iter().map(|e| (e.from_top.as_str(), e.to_top.as_str())).collect();
    let gone: Vec<String> = NOT_YET
        .iter()
        .filter(|(a, b, _)| !there.contains(&(*a, *b)))
        .map(|(a, b, _)| format!("`{a}` no longer imports `{b}`: strike that line from NOT_YET in {}", file!()))
        .collect();
    assert!(gone.is_empty(), "\n{}\n", gone.join("\n"));
}

/// The reader finds what it must: a made-up tree with one edge of each kind.
/// Issue 32: no file of `daemon/src` but a test file (`tests.rs`, `*_tests.rs`) is over 800
/// lines; one that grows past it is split by concern, not by count.
#[test]
fn no_source_file_is_over_800_lines() {
    const MOST: usize = 800;
    fn walk(dir: &Path, out: &mut Vec<(PathBuf, usize)>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let name = path.file_stem().unwrap().to_string_lossy();
                if name != "tests" && !name.ends_with("_tests") {
                    out.push((path.clone(), std::fs::read_to_string(&path).unwrap().lines().count()));
                }
            }
        }
    }
    let mut files = Vec::new();
    walk(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &mut files);
    assert!(files.len() > 50, "daemon/src read: {} files", files.len());
    let over: Vec<String> = files
        .iter()
        .filter(|(_, n)| *n > MOST)
        .map(|(p, n)| {
            format!(
                "{} has {n} lines: split it by concern (a sibling module, or its tests into a `*_tests.rs` file)",
                p.display()
            )
        })
        .collect();
    assert!(over.is_empty(), "over {MOST} lines:\n{}", over.join("\n"));
}

#[test]
fn the_reader_sees_every_kind_of_path() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    std::fs::write(src.join("lib.rs"), "pub mod a;\npub mod b;\n#[cfg(test)]\nmod t;\n").unwrap();
    std::fs::create_dir(src.join("a")).unwrap();
    std::fs::write(src.join("a/mod.rs"), "pub mod x;\npub mod y;\nuse crate::b::{self, B as C};\n").unwrap();
    std::fs::write(
        src.join("a/x.rs"),
        "fn f() { let _ = super::y::Y; tracing::info!(\"{}\", crate::b::g()); }\n\
         #[cfg(test)]\nmod tests { use crate::b::Hidden; }\n",
    )
    .unwrap();
    std::fs::write(
        src.join("a/y.rs"),
        "pub struct Y;\n// crate::b::InAComment\nfn g() -> String { \"crate::b::s\".into() }\n",
    )
    .unwrap();
    std::fs::write(src.join("b.rs"), "pub struct B;\npub fn g() {}\n").unwrap();
    let tree = Tree::read_from(src);
    assert_eq!(tree.top_modules, ["a", "b"]);
    let seen: Vec<(String, u32, String)> =
        tree.edges.iter().map(|e| (e.file.display().to_string(), e.line, e.path.clone())).collect();
    let a = |f: &str| src.join(f).display().to_string();
    assert_eq!(
        seen,
        [
            (a("a/mod.rs"), 3, "crate::b".to_owned()),
            (a("a/mod.rs"), 3, "crate::b::B".to_owned()),
            (a("a/x.rs"), 1, "crate::a::y::Y".to_owned()),
            (a("a/x.rs"), 1, "crate::b::g".to_owned()),
        ]
    );
}

/// Each check fails on what it is for, naming the file, line, path and floors: a made-up crate
/// with an edge up a floor, one across faces, a circle of modules and a circle of a folder's
/// files; and an edge in the not-yet list is passed over.
#[test]
fn the_checks_name_each_offence() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    let write = |f: &str, text: &str| std::fs::write(src.join(f), text).unwrap();
    write("lib.rs", "mod low;\nmod mid;\nmod high;\nmod face;\nmod other_face;\nmod folder;\n");
    write("low.rs", "pub struct L;\nfn f() -> crate::high::H { todo!() }\n");
    write("mid.rs", "use crate::low::L;\npub use crate::face::F;\n");
    write("high.rs", "pub struct H;\nuse crate::mid::M;\n");
    write("face.rs", "pub struct F;\nuse crate::other_face::O;\n");
    write("other_face.rs", "pub struct O;\n");
    std::fs::create_dir(src.join("folder")).unwrap();
    write("folder/mod.rs", "mod a;\nmod b;\n");
    write("folder/a.rs", "use super::b::B;\npub struct A;\n");
    write("folder/b.rs", "pub struct B;\nfn g() { let _ = super::a::A; }\n");
    let tree = Tree::read_from(src);
    let floors =
        [("low", Core), ("mid", State), ("high", Control), ("face", Faces), ("other_face", Faces), ("folder", Base)];
    let rules = Rules { floors: &floors, not_yet: &[] };
    let at = |f: &str, line: u32| format!("{}:{line}", src.join(f).display());
    let edges = rules.offending_edges(&tree);
    assert_eq!(edges.len(), 3, "{edges:#?}");
    assert!(
        edges
            .iter()
            .any(|e| e.starts_with(&format!("{}: the face `face` imports `crate::other_face::O`", at("face.rs", 2))))
    );
    assert!(edges.iter().any(|e| e.starts_with(&format!(
        "{}: `low` (Core) imports `crate::high::H` from `high` (Control), a higher floor",
        at("low.rs", 2)
    ))));
    assert!(
        edges.iter().any(|e| e.starts_with(&format!("{}: `mid` (State) imports `crate::face::F`", at("mid.rs", 2))))
    );
    let circles = rules.circles(&tree);
    assert_eq!(circles.len(), 2, "{circles:#?}");
    assert!(
        circles[0].starts_with("an import circle between the modules of daemon/src: high → low → mid."),
        "{circles:#?}"
    );
    assert!(circles[0].contains(&format!("low → high: {}: crate::high::H", at("low.rs", 2))), "{circles:#?}");
    assert!(circles[1].starts_with("an import circle between the files of crate::folder: a → b."), "{circles:#?}");
    // An edge the list names is not an offence, nor part of a circle.
    let rules = Rules { floors: &floors, not_yet: &[("low", "high", "being moved"), ("face", "other_face", "")] };
    assert_eq!(rules.offending_edges(&tree).len(), 1);
    assert_eq!(rules.circles(&tree).len(), 1);
}

/// The floors and the edges not yet broken, as the checks read them.
struct Rules<'a> {
    floors: &'a [(&'a str, Floor)],
    not_yet: &'a [(&'a str, &'a str, &'a str)],
}

const RULES: Rules<'static> = Rules { floors: FLOORS, not_yet: NOT_YET };

impl Rules<'_> {
    fn floor_of(&self, module: &str) -> Option<Floor> {
        self.floors.iter().find(|(m, _)| *m == module).map(|(_, f)| *f)
    }

    fn not_yet(&self, from: &str, to: &str) -> bool {
        self.not_yet.iter().any(|(a, b, _)| *a == from && *b == to)
    }

    /// Every edge up a floor or from a face to another, with how to mend it.
    fn offending_edges(&self, tree: &Tree) -> Vec<String> {
        let mut problems = Vec::new();
        for e in &tree.edges {
            let (Some(from), Some(to)) = (self.floor_of(&e.from_top), self.floor_of(&e.to_top)) else { continue };
            if e.from_top == e.to_top || self.not_yet(&e.from_top, &e.to_top) {
                continue;
            }
            if to > from {
                problems.push(format!(
                    "{}: `{}` ({from:?}) imports `{}` from `{}` ({to:?}), a higher floor. A floor imports only its \
                 own and those below: move the item down to `{}`'s floor or lower (a type both use belongs to the \
                 lower floor), or have the higher floor hand it in (a value, a closure, or a trait the lower \
                 floor defines and the higher one implements)",
                    e.at(),
                    e.from_top,
                    e.path,
                    e.to_top,
                    e.from_top
                ));
            } else if from == Faces && to == Faces {
                problems.push(format!(
                    "{}: the face `{}` imports `{}` from the face `{}`. A face never reaches into another: move what \
                 both need down to core (data) or control (an operation)",
                    e.at(),
                    e.from_top,
                    e.path,
                    e.to_top
                ));
            }
        }
        problems
    }

    /// Every import circle: between the crate's modules, and between the files of one folder.
    fn circles(&self, tree: &Tree) -> Vec<String> {
        let mut problems = Vec::new();
        // One graph per parent module: its children, joined by the edges between their subtrees
        // (the crate's top modules are the children of the root). A module's edges to its own parent
        // and ancestors are not circles of this kind: a folder's `mod.rs` declares its files.
        let mut graphs: BTreeMap<Vec<String>, Graph> = BTreeMap::new();
        for e in &tree.edges {
            if self.not_yet(&e.from_top, &e.to_top) {
                continue;
            }
            let common = e.from.iter().zip(&e.to).take_while(|(a, b)| a == b).count();
            if common >= e.from.len() || common >= e.to.len() {
                continue;
            }
            graphs
                .entry(e.from[..common].to_vec())
                .or_default()
                .entry(e.from[common].clone())
                .or_default()
                .entry(e.to[common].clone())
                .or_default()
                .push(e);
        }
        for (parent, graph) in &graphs {
            for circle in circles(graph) {
                let place = if parent.is_empty() {
                    "between the modules of daemon/src".to_owned()
                } else {
                    format!("between the files of crate::{}", parent.join("::"))
                };
                let mut ties = Vec::new();
                for a in &circle {
                    for b in &circle {
                        if let Some([first, more @ ..]) = graph.get(*a).and_then(|to| to.get(*b)).map(Vec::as_slice) {
                            let more =
                                if more.is_empty() { String::new() } else { format!(" (and {} more)", more.len()) };
                            ties.push(format!("    {a} → {b}: {}: {}{more}", first.at(), first.path));
                        }
                    }
                }
                problems.push(format!(
                    "an import circle {place}: {}. Break it: move what the lower of them takes from the others into \
                 it, or into a new module that all of them import; ties:\n{}",
                    circle.join(" → "),
                    ties.join("\n")
                ));
            }
        }
        problems
    }
}

/// One import: a path in `file` at `line`, from module `from` to module `to` (the longest prefix
/// of the path that is a module).
#[derive(Debug)]
struct Edge {
    file: PathBuf,
    line: u32,
    from: Vec<String>,
    to: Vec<String>,
    from_top: String,
    to_top: String,
    path: String,
}

impl Edge {
    fn at(&self) -> String {
        let shown = self
            .file
            .strip_prefix(env!("CARGO_MANIFEST_DIR"))
            .map_or(self.file.clone(), |p| Path::new("daemon").join(p));
        format!("{}:{}", shown.display(), self.line)
    }
}

/// The library's module tree and its edges.
struct Tree {
    top_modules: Vec<String>,
    edges: Vec<Edge>,
}

impl Tree {
    /// `daemon/src`, read once for all the tests.
    fn read() -> &'static Tree {
        static TREE: std::sync::OnceLock<Tree> = std::sync::OnceLock::new();
        TREE.get_or_init(|| Tree::read_from(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src")))
    }

    fn read_from(src: &Path) -> Tree {
        let mut files = Vec::new();
        collect(&src.join("lib.rs"), Vec::new(), &mut files);
        let modules: BTreeSet<Vec<String>> = files.iter().map(|(_, m, _)| m.clone()).collect();
        let top_modules = modules.iter().filter(|m| m.len() == 1).map(|m| m[0].clone()).collect();
        let mut edges = Vec::new();
        for (file, module, ast) in &files {
            let mut paths = Paths { module: module.clone(), found: Vec::new() };
            paths.visit_file(ast);
            for (line, path) in paths.found {
                let mut to = path.clone();
                while !to.is_empty() && !modules.contains(&to) {
                    to.pop();
                }
                // A name the crate root holds (lib.rs), or an external crate's.
                if to.is_empty() || module.is_empty() {
                    continue;
                }
                edges.push(Edge {
                    file: file.clone(),
                    line,
                    from_top: module[0].clone(),
                    to_top: to[0].clone(),
                    from: module.clone(),
                    to,
                    path: format!("crate::{}", path.join("::")),
                });
            }
        }
        edges.sort_by(|a, b| (&a.file, a.line, &a.path).cmp(&(&b.file, b.line, &b.path)));
        edges.dedup_by(|a, b| (&a.file, a.line, &a.path) == (&b.file, b.line, &b.path));
        Tree { top_modules, edges }
    }
}

/// Parses `file` (module `module`) and, through its `mod name;` items, every file below it that
/// is compiled outside tests.
fn collect(file: &Path, module: Vec<String>, out: &mut Vec<(PathBuf, Vec<String>, syn::File)>) {
    let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let ast = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let owns_dir = matches!(file.file_name().and_then(|n| n.to_str()), Some("lib.rs" | "mod.rs"));
    let here = file.parent().expect("a file has a folder");
    let dir = if owns_dir { here.to_path_buf() } else { file.with_extension("") };
    for item in &ast.items {
        let syn::Item::Mod(m) = item else { continue };
        if m.content.is_some() || is_test_only(&m.attrs) {
            continue;
        }
        let name = m.ident.to_string();
        let child = match path_attr(&m.attrs) {
            Some(p) => here.join(p),
            None if dir.join(format!("{name}.rs")).exists() => dir.join(format!("{name}.rs")),
            None => dir.join(&name).join("mod.rs"),
        };
        let mut child_module = module.clone();
        child_module.push(name);
        collect(&child, child_module, out);
    }
    out.push((file.to_path_buf(), module, ast));
}

fn path_attr(attrs: &[syn::Attribute]) -> Option<String> {
    attrs.iter().find(|a| a.path().is_ident("path")).and_then(|a| match &a.meta {
        syn::Meta::NameValue(nv) => match &nv.value {
            syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Str(s), .. }) => Some(s.value()),
            _ => None,
        },
        _ => None,
    })
}

/// `#[cfg(test)]`, alone or inside `all(...)`.
fn is_test_only(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && a.parse_args::<syn::Meta>().is_ok_and(|m| match m {
                syn::Meta::Path(p) => p.is_ident("test"),
                syn::Meta::List(l) => {
                    l.path.is_ident("all") && l.tokens.clone().into_iter().any(|t| t.to_string() == "test")
                }
                _ => false,
            })
    })
}

/// The paths of one file, resolved to absolute module paths (without `crate`).
struct Paths {
    module: Vec<String>,
    found: Vec<(u32, Vec<String>)>,
}

impl Paths {
    /// `crate::a::b`, `super::b`, `self::b` from the current module; `None` for other paths.
    fn resolve(&self, segments: &[String]) -> Option<Vec<String>> {
        let (first, rest) = segments.split_first()?;
        let mut out = match first.as_str() {
            "crate" => Vec::new(),
            "self" => self.module.clone(),
            "super" => {
                let mut m = self.module.clone();
                m.pop();
                m
            }
            _ => return None,
        };
        let mut rest = rest;
        while first == "super" && rest.first().is_some_and(|s| s == "super") {
            out.pop();
            rest = &rest[1..];
        }
        out.extend(rest.iter().filter(|s| *s != "self" && *s != "*").cloned());
        Some(out)
    }

    fn add(&mut self, line: usize, segments: &[String]) {
        if let Some(p) = self.resolve(segments)
            && !p.is_empty()
        {
            self.found.push((line as u32, p));
        }
    }

    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(prefix, &p.tree);
                prefix.pop();
            }
            syn::UseTree::Name(n) => self.use_leaf(prefix, &n.ident),
            syn::UseTree::Rename(r) => self.use_leaf(prefix, &r.ident),
            syn::UseTree::Glob(g) => self.add(g.star_token.spans[0].start().line, prefix),
            syn::UseTree::Group(g) => {
                for t in &g.items {
                    self.use_tree(prefix, t);
                }
            }
        }
    }

    fn use_leaf(&mut self, prefix: &mut Vec<String>, ident: &syn::Ident) {
        prefix.push(ident.to_string());
        self.add(ident.span().start().line, prefix);
        prefix.pop();
    }

    /// `crate :: a :: b` runs inside a macro's tokens (`format!`, `tokio::select!`, ...).
    fn tokens(&mut self, tokens: TokenStream) {
        let trees: Vec<TokenTree> = tokens.into_iter().collect();
        let mut i = 0;
        while i < trees.len() {
            if let TokenTree::Group(g) = &trees[i] {
                self.tokens(g.stream());
                i += 1;
                continue;
            }
            let start = match &trees[i] {
                TokenTree::Ident(id) if ["crate", "super", "self"].contains(&id.to_string().as_str()) => id,
                _ => {
                    i += 1;
                    continue;
                }
            };
            let mut segments = vec![start.to_string()];
            let mut j = i + 1;
            while let (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b)), Some(TokenTree::Ident(id))) =
                (trees.get(j), trees.get(j + 1), trees.get(j + 2))
            {
                if a.as_char() != ':' || b.as_char() != ':' {
                    break;
                }
                segments.push(id.to_string());
                j += 3;
            }
            if segments.len() > 1 {
                self.add(start.span().start().line, &segments);
            }
            i = j.max(i + 1);
        }
    }
}

impl<'ast> Visit<'ast> for Paths {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        if !is_test_only(item_attrs(item)) {
            syn::visit::visit_item(self, item);
        }
    }

    fn visit_impl_item(&mut self, item: &'ast syn::ImplItem) {
        let attrs = match item {
            syn::ImplItem::Const(i) => &i.attrs,
            syn::ImplItem::Fn(i) => &i.attrs,
            syn::ImplItem::Type(i) => &i.attrs,
            syn::ImplItem::Macro(i) => &i.attrs,
            _ => return syn::visit::visit_impl_item(self, item),
        };
        if !is_test_only(attrs) {
            syn::visit::visit_impl_item(self, item);
        }
    }

    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        // A file module is read from its own file; an inline one here, one level down.
        if let Some((_, items)) = &m.content {
            self.module.push(m.ident.to_string());
            for item in items {
                self.visit_item(item);
            }
            self.module.pop();
        }
    }

    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        self.use_tree(&mut Vec::new(), &u.tree);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        if let Some(first) = path.segments.first() {
            self.add(first.ident.span().start().line, &segments);
        }
        syn::visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.visit_path(&mac.path);
        self.tokens(mac.tokens.clone());
    }

    // `pub(in crate::a)` says who may see an item, not what it uses.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}
}

fn item_attrs(item: &syn::Item) -> &[syn::Attribute] {
    use syn::Item::*;
    match item {
        Const(i) => &i.attrs,
        Enum(i) => &i.attrs,
        ExternCrate(i) => &i.attrs,
        Fn(i) => &i.attrs,
        ForeignMod(i) => &i.attrs,
        Impl(i) => &i.attrs,
        Macro(i) => &i.attrs,
        Mod(i) => &i.attrs,
        Static(i) => &i.attrs,
        Struct(i) => &i.attrs,
        Trait(i) => &i.attrs,
        TraitAlias(i) => &i.attrs,
        Type(i) => &i.attrs,
        Union(i) => &i.attrs,
        Use(i) => &i.attrs,
        _ => &[],
    }
}

/// Module → module it imports → the edges that make it so.
type Graph<'a> = BTreeMap<String, BTreeMap<String, Vec<&'a Edge>>>;

/// The circles (strongly connected sets of two or more) of `graph`, each in a fixed order.
fn circles<'a>(graph: &'a Graph<'a>) -> Vec<Vec<&'a str>> {
    struct Tarjan<'a> {
        graph: &'a Graph<'a>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        out: Vec<Vec<&'a str>>,
    }
    impl<'a> Tarjan<'a> {
        fn visit(&mut self, v: &'a str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            for w in self.graph.get(v).into_iter().flat_map(|to| to.keys()) {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    self.low.insert(v, self.low[v].min(self.low[w]));
                } else if self.stack.contains(&w) {
                    self.low.insert(v, self.low[v].min(self.index[w]));
                }
            }
            if self.low[v] == self.index[v] {
                let at = self.stack.iter().position(|x| *x == v).expect("on the stack");
                let mut set = self.stack.split_off(at);
                if set.len() > 1 {
                    set.sort_unstable();
                    self.out.push(set);
                }
            }
        }
    }
    let mut t = Tarjan { graph, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), out: Vec::new() };
    for v in graph.keys() {
        if !t.index.contains_key(v.as_str()) {
            t.visit(v);
        }
    }
    t.out
}
