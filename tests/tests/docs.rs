//! The documentation points at what exists: every relative link in README.md
//! and docs/*.md names a file or folder of the repository, and every
//! docs page a source file cites is there.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The targets of the Markdown links `[text](target)` in `text`.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("](") {
        rest = &rest[i + 2..];
        if let Some(end) = rest.find(')') {
            out.push(rest[..end].to_owned());
        }
    }
    out
}

/// The Markdown pages: README.md and docs/*.md.
fn pages() -> Vec<PathBuf> {
    let mut pages = vec![root().join("README.md")];
    for e in std::fs::read_dir(root().join("docs")).expect("docs/") {
        let p = e.expect("an entry").path();
        if p.extension().is_some_and(|x| x == "md") {
            pages.push(p);
        }
    }
    pages
}

#[test]
fn every_relative_link_resolves() {
    weft_tests::isolated!();
    let mut broken = Vec::new();
    let mut seen = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("a page");
        for target in links(&text) {
            if target.contains("://") || target.starts_with('#') || target.starts_with("mailto:") {
                continue;
            }
            let file = target.split('#').next().unwrap_or_default();
            let at = page.parent().expect("a folder").join(file);
            seen += 1;
            if !at.exists() {
                broken.push(format!("{}: {target}", page.display()));
            }
        }
    }
    assert!(seen > 20, "the pages link to each other ({seen} links)");
    assert!(
        broken.is_empty(),
        "links to nothing:\n{}",
        broken.join("\n")
    );
}

/// Every `docs/<page>.md` a source file of the workspace names.
#[test]
fn every_cited_page_exists() {
    weft_tests::isolated!();
    let mut missing = Vec::new();
    let mut cited = 0;
    let mut stack: Vec<PathBuf> = ["plugin", "tests", "macros", "codegen", "api-versions"]
        .iter()
        .map(|d| root().join(d))
        .collect();
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).expect("a folder") {
            let p = e.expect("an entry").path();
            if p.is_dir() {
                if p.file_name().is_some_and(|n| n != "target") {
                    stack.push(p);
                }
                continue;
            }
            if p.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&p).unwrap_or_default();
            let mut rest = text.as_str();
            while let Some(i) = rest.find("docs/") {
                rest = &rest[i + 5..];
                let name: String = rest
                    .chars()
                    .take_while(|c| {
                        c.is_ascii_alphanumeric() || *c == '-' || *c == '_' || *c == '.'
                    })
                    .collect();
                if let Some(page) = name
                    .strip_suffix('.')
                    .or(Some(&name))
                    .filter(|n| n.ends_with(".md"))
                {
                    cited += 1;
                    if !root().join("docs").join(page).exists() {
                        missing.push(format!("{}: docs/{page}", p.display()));
                    }
                }
            }
        }
    }
    assert!(cited > 3, "the sources cite the docs ({cited} citations)");
    assert!(
        missing.is_empty(),
        "cited pages missing:\n{}",
        missing.join("\n")
    );
}
