//! The plugin crate's layers, as a check: every module may use only the
//! modules of lower layers (and its own). The test parses every source file
//! of `plugin/src` with syn, resolves each `crate::…` and `super::…` path
//! (in `use` items and in expressions and types alike) to the top-level
//! module it names, and fails on every edge that points sideways or up,
//! naming the file and the path. Doc links are not code and are not read.
//!
//! The layers, lowest first (docs/architecture.md draws them):
//! 0. leaves: `nccl` (NCCL's constants, the handle codec), `memkind`, `log`;
//! 1. `config`;
//! 2. `fabric` (libfabric), `gpu` (the CUDA driver);
//! 3. `freelist`, `device`;
//! 4. `mr`, `error`;
//! 5. `proto` (the protocols: hub, comms, handshake, wire);
//! 6. `core` (the version-free plugin: contexts, devices, registrations, the keeper);
//! 7. `collnet` and `rma` (NCCL's CollNet and RMA plugins over the core);
//! 8. `adapter` (the C boundary the generated tables call), `testing` (the
//!    hooks and framing only Weft's tests use, cargo feature `testing`),
//!    `tools` (what the `weft` and `weft-reducer` programs use).
//!
//! `lib.rs` (the crate root, with the generated tables) and the binaries
//! sit above everything.

use std::collections::BTreeMap;
use std::path::Path;

use syn::visit::Visit;

const LAYERS: &[&[&str]] = &[
    &["nccl", "memkind", "log"],
    &["config"],
    &["fabric", "gpu"],
    &["freelist", "device"],
    &["mr", "error"],
    &["proto"],
    &["core"],
    &["collnet", "rma"],
    &["adapter", "testing", "tools"],
];

fn layer(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

/// The module path of a source file: `proto/comms/mod.rs` is
/// `["proto", "comms"]`, `proto/hub.rs` is `["proto", "hub"]`.
fn module_of(rel: &Path) -> Vec<String> {
    let mut m: Vec<String> = rel
        .iter()
        .map(|c| c.to_string_lossy().trim_end_matches(".rs").to_owned())
        .collect();
    if m.last().is_some_and(|l| l == "mod") {
        m.pop();
    }
    m
}

/// Collects the top-level module every `crate::`/`super::` path names,
/// with the path as written, from a file of module `here` (nested inline
/// modules push onto it as they are entered).
struct Paths {
    here: Vec<String>,
    found: Vec<(String, String)>,
}

impl Paths {
    /// Resolves a path's first segments; `None` when it does not leave the
    /// current top-level module through `crate` or `super`.
    fn resolve(&self, segs: &[String]) -> Option<String> {
        let mut at = self.here.clone();
        let mut i = 0;
        match segs.first().map(String::as_str) {
            Some("crate") => {
                at.clear();
                i = 1;
            }
            Some("super") => {
                while segs.get(i).is_some_and(|s| s == "super") {
                    at.pop();
                    i += 1;
                }
            }
            _ => return None,
        }
        match at.first() {
            Some(top) => Some(top.clone()),
            None => segs.get(i).cloned(),
        }
    }

    fn note(&mut self, segs: Vec<String>) {
        if let Some(top) = self.resolve(&segs) {
            self.found.push((top, segs.join("::")));
        }
    }
}

/// The paths a `use` tree names, each as its list of segments.
fn use_paths(tree: &syn::UseTree, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            use_paths(&p.tree, prefix, out);
            prefix.pop();
        }
        syn::UseTree::Name(n) => {
            let mut v = prefix.clone();
            v.push(n.ident.to_string());
            out.push(v);
        }
        syn::UseTree::Rename(r) => {
            let mut v = prefix.clone();
            v.push(r.ident.to_string());
            out.push(v);
        }
        syn::UseTree::Glob(_) => {
            let mut v = prefix.clone();
            v.push("*".to_owned());
            out.push(v);
        }
        syn::UseTree::Group(g) => {
            for t in &g.items {
                use_paths(t, prefix, out);
            }
        }
    }
}

impl<'ast> Visit<'ast> for Paths {
    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        let mut out = Vec::new();
        use_paths(&u.tree, &mut Vec::new(), &mut out);
        for segs in out {
            self.note(segs);
        }
    }
    fn visit_path(&mut self, p: &'ast syn::Path) {
        self.note(p.segments.iter().map(|s| s.ident.to_string()).collect());
        syn::visit::visit_path(self, p);
    }
    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        self.here.push(m.ident.to_string());
        syn::visit::visit_item_mod(self, m);
        self.here.pop();
    }
    // Macro bodies are token streams syn does not parse; the plugin's own
    // macros name their paths through `$crate`, which this check cannot
    // follow, so they are the one blind spot.
}

#[test]
fn no_import_runs_against_the_layers() {
    weft_tests::isolated!();
    let mut bad: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut unknown = Vec::new();
    for (rel, text) in &weft_tests::plugin_sources() {
        let rel = rel.as_path();
        let here = module_of(rel);
        let Some(top) = here.first().cloned() else {
            continue;
        };
        if top == "lib" || top == "bin" {
            continue;
        }
        let Some(mine) = layer(&top) else {
            unknown.push(rel.display().to_string());
            continue;
        };
        let file = syn::parse_file(text).unwrap_or_else(|e| panic!("{}: {e}", rel.display()));
        let mut v = Paths {
            here: here.clone(),
            found: Vec::new(),
        };
        v.visit_file(&file);
        for (to, written) in v.found {
            if to == top {
                continue;
            }
            match layer(&to) {
                Some(theirs) if theirs < mine => {}
                Some(theirs) => bad
                    .entry(rel.display().to_string())
                    .or_default()
                    .push(format!(
                        "{written} ({top}, layer {mine}, uses {to}, layer {theirs})"
                    )),
                None => bad
                    .entry(rel.display().to_string())
                    .or_default()
                    .push(format!("{written}: {to} is in no layer")),
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "modules in no layer (add them to LAYERS): {unknown:?}"
    );
    let report: Vec<String> = bad
        .iter()
        .map(|(f, v)| {
            let mut v = v.clone();
            v.sort();
            v.dedup();
            format!("{f}:\n    {}", v.join("\n    "))
        })
        .collect();
    assert!(
        report.is_empty(),
        "imports against the layers:\n{}",
        report.join("\n")
    );
}

/// What a crate root declares: the modules named in its `layers!` call
/// (public only under the `testing` feature), and the modules it declares
/// `pub` in a build without that feature.
fn root_surface(file: &syn::File) -> (Vec<String>, Vec<String>) {
    let mut layered = Vec::new();
    let mut public = Vec::new();
    for item in &file.items {
        match item {
            syn::Item::Macro(m) if m.mac.path.is_ident("layers") => {
                let names = m
                    .mac
                    .parse_body_with(
                        syn::punctuated::Punctuated::<syn::Ident, syn::Token![,]>::parse_terminated,
                    )
                    .expect("layers!(a, b, ...)");
                layered.extend(names.iter().map(|i| i.to_string()));
            }
            syn::Item::Mod(m) if matches!(m.vis, syn::Visibility::Public(_)) => {
                let testing_only = m.attrs.iter().any(|a| {
                    a.path().is_ident("cfg")
                        && a.meta.require_list().is_ok_and(|l| {
                            l.tokens.to_string().replace(' ', "") == "feature=\"testing\""
                        })
                });
                if !testing_only {
                    public.push(m.ident.to_string());
                }
            }
            _ => {}
        }
    }
    (layered, public)
}

/// The shipped library (built without the `testing` feature) makes every
/// layer crate-private: the `layers!` call in lib.rs names each module of
/// LAYERS but `testing` (which exists only under the feature) and `tools`
/// (the one public module, for the two programs), and lib.rs declares no
/// other public module. With that, code only tests use is dead code in a
/// release build, and CI's `cargo clippy -p weft` fails on it.
#[test]
fn the_shipped_library_makes_its_layers_private() {
    weft_tests::isolated!();
    let sources = weft_tests::plugin_sources();
    let (_, lib) = sources
        .iter()
        .find(|(rel, _)| rel.as_path() == Path::new("lib.rs"))
        .expect("plugin/src/lib.rs");
    let (mut layered, public) = root_surface(&syn::parse_file(lib).expect("lib.rs parses"));
    layered.sort();
    let mut want: Vec<String> = LAYERS
        .iter()
        .flat_map(|l| l.iter())
        .filter(|m| !["testing", "tools"].contains(m))
        .map(|m| m.to_string())
        .collect();
    want.sort();
    assert_eq!(layered, want, "lib.rs's layers! call and LAYERS differ");
    assert_eq!(public, ["tools"], "public modules of the shipped library");
    // And the check can fail: a module declared `pub` outright is found,
    // one declared `pub` only under the feature is not.
    let (l, p) = root_surface(
        &syn::parse_str(
            "layers!(a, b);\n#[cfg(feature = \"testing\")] pub mod testing;\npub mod proto;",
        )
        .unwrap(),
    );
    assert_eq!(
        (l, p),
        (vec!["a".into(), "b".into()], vec!["proto".to_owned()])
    );
}

/// The check itself can fail: an edge up is found, in a `use` group, in a
/// `super::super` path and in an expression.
#[test]
fn the_check_finds_an_edge_up() {
    weft_tests::isolated!();
    let file: syn::File = syn::parse_str(
        "use crate::{error::Error, core::keeper};\n\
         fn f() { super::super::collnet::go(); let _ = crate::adapter::X; }",
    )
    .unwrap();
    let mut v = Paths {
        here: vec!["proto".into(), "comms".into()],
        found: Vec::new(),
    };
    v.visit_file(&file);
    let tops: Vec<&str> = v.found.iter().map(|(t, _)| t.as_str()).collect();
    assert!(
        tops.contains(&"core") && tops.contains(&"error"),
        "{tops:?}"
    );
    assert!(tops.contains(&"adapter"), "{tops:?}");
    // super::super from proto::comms is the crate root: collnet.
    assert!(tops.contains(&"collnet"), "{tops:?}");
}

/// The core's entry points that take and give NCCL's tokens (pointers
/// standing for comms, memory handles and requests).
const TOKEN_CALLS: &[&str] = &[
    "listen",
    "connect",
    "accept",
    "isend",
    "irecv",
    "iflush",
    "test",
    "reg_mr",
    "reg_mr_dma_buf",
    "dereg_mr",
    "close_send",
    "close_recv",
    "close_listen",
];

/// Paths `core::<token call>` a file names.
#[derive(Default)]
struct TokenCalls(Vec<String>);

impl<'ast> Visit<'ast> for TokenCalls {
    fn visit_path(&mut self, p: &'ast syn::Path) {
        let segs: Vec<String> = p.segments.iter().map(|s| s.ident.to_string()).collect();
        if segs
            .windows(2)
            .any(|w| w[0] == "core" && TOKEN_CALLS.contains(&w[1].as_str()))
        {
            self.0.push(segs.join("::"));
        }
        syn::visit::visit_path(self, p);
    }
}

fn token_calls(text: &str) -> Vec<String> {
    let file = syn::parse_file(text).expect("a source file");
    let mut v = TokenCalls::default();
    v.visit_file(&file);
    v.0
}

/// Tokens are for NCCL: CollNet and the reduction server drive the core
/// through its typed API (`core::SendComm`, `MemHandle`, `Request`, …),
/// never through the entry points that take NCCL's tokens.
#[test]
fn collnet_drives_the_core_without_tokens() {
    weft_tests::isolated!();
    let found: Vec<String> = weft_tests::plugin_sources()
        .iter()
        .filter(|(rel, _)| rel.starts_with("collnet"))
        .flat_map(|(rel, text)| {
            token_calls(text)
                .into_iter()
                .map(move |c| format!("{}: {c}", rel.display()))
        })
        .collect();
    assert!(
        found.is_empty(),
        "CollNet calls the core's token entry points: {found:?}"
    );
    // The check can fail: the calls CollNet made before the typed API.
    assert_eq!(
        token_calls("fn f() { core::test(p(q)); let _ = crate::core::reg_mr(a, b, c, d); }"),
        ["core::test", "crate::core::reg_mr"]
    );
}
