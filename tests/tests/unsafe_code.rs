//! Where `unsafe` may live in the plugin crate, as a check: every leaf
//! module (a file with no child modules) of `plugin/src` that has no
//! `unsafe` of its own (no unsafe block, fn, impl, trait or extern block)
//! must say `#![forbid(unsafe_code)]`, so that the next change cannot bring
//! unsafe code into it without saying so there. (rustc then refuses any
//! unsafe in it, macro expansions included.) Modules with children are not
//! required to: a `forbid` there would bind the children too. The crate root
//! and the binaries are outside the check.

use syn::visit::Visit;

/// Counts what is unsafe in a file, and its child modules.
#[derive(Default)]
struct Scan {
    unsafe_items: usize,
    child_modules: usize,
}

impl<'ast> Visit<'ast> for Scan {
    fn visit_expr_unsafe(&mut self, e: &'ast syn::ExprUnsafe) {
        self.unsafe_items += 1;
        syn::visit::visit_expr_unsafe(self, e);
    }
    fn visit_signature(&mut self, s: &'ast syn::Signature) {
        self.unsafe_items += usize::from(s.unsafety.is_some());
        syn::visit::visit_signature(self, s);
    }
    fn visit_item_impl(&mut self, i: &'ast syn::ItemImpl) {
        self.unsafe_items += usize::from(i.unsafety.is_some());
        syn::visit::visit_item_impl(self, i);
    }
    fn visit_item_trait(&mut self, t: &'ast syn::ItemTrait) {
        self.unsafe_items += usize::from(t.unsafety.is_some());
        syn::visit::visit_item_trait(self, t);
    }
    fn visit_item_foreign_mod(&mut self, f: &'ast syn::ItemForeignMod) {
        self.unsafe_items += 1;
        syn::visit::visit_item_foreign_mod(self, f);
    }
    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        // `mod x;` (a child in its own file); an inline `mod x { ... }` is
        // part of this file and scanned with it.
        self.child_modules += usize::from(m.content.is_none());
        syn::visit::visit_item_mod(self, m);
    }
}

/// Whether the file's inner attributes include `#![forbid(unsafe_code)]`.
fn forbids_unsafe(file: &syn::File) -> bool {
    file.attrs.iter().any(|a| {
        a.path().is_ident("forbid")
            && a.parse_args::<syn::Path>()
                .is_ok_and(|p| p.is_ident("unsafe_code"))
    })
}

/// The leaf files with no unsafe code that do not forbid it.
fn missing(text_of: &[(String, String)]) -> Vec<String> {
    let mut bad = Vec::new();
    for (name, text) in text_of {
        let file = syn::parse_file(text).unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut s = Scan::default();
        s.visit_file(&file);
        if s.child_modules == 0 && s.unsafe_items == 0 && !forbids_unsafe(&file) {
            bad.push(name.clone());
        }
    }
    bad
}

#[test]
fn leaf_modules_without_unsafe_forbid_it() {
    weft_tests::isolated!();
    let texts: Vec<(String, String)> = weft_tests::plugin_sources()
        .into_iter()
        .map(|(rel, text)| (rel.display().to_string(), text))
        .filter(|(name, _)| name != "lib.rs" && !name.starts_with("bin/"))
        .collect();
    assert!(texts.len() > 40, "read only {} files", texts.len());
    let bad = missing(&texts);
    assert!(
        bad.is_empty(),
        "these modules have no unsafe code: say #![forbid(unsafe_code)] after their doc comment: {bad:?}"
    );
}

/// The check can fail: a leaf without unsafe and without the attribute is
/// found; one with an unsafe block, one with the attribute and one with a
/// child module are not.
#[test]
fn the_check_finds_a_leaf_without_the_attribute() {
    let cases = [
        ("plain.rs", "//! doc\nfn f() {}\n"),
        (
            "unsafe_block.rs",
            "fn f(p: *const u8) -> u8 { unsafe { *p } }\n",
        ),
        ("unsafe_fn.rs", "unsafe fn f() {}\n"),
        (
            "forbids.rs",
            "//! doc\n#![forbid(unsafe_code)]\nfn f() {}\n",
        ),
        ("parent.rs", "mod child;\nfn f() {}\n"),
        ("inline_mod.rs", "mod inner { pub fn f() {} }\n"),
    ];
    let texts: Vec<(String, String)> = cases
        .iter()
        .map(|(n, t)| ((*n).to_owned(), (*t).to_owned()))
        .collect();
    assert_eq!(missing(&texts), ["plain.rs", "inline_mod.rs"]);
}
