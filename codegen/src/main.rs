//! `weft-codegen`: NCCL headers -> version descriptors in `api-versions/src/generated/`.
//!
//! ```text
//! weft-codegen --write <dir> [--only net|collnet|rma] [--versions 9-12] [--out DIR]
//! weft-codegen --check <dir> [--versions 5-8] [--out DIR]
//! weft-codegen --print <dir>
//! ```
//! `<dir>`: an installed include directory (nccl_net.h + nccl.h, e.g. from the
//! nvidia-nccl-cu12 wheel), or an NCCL source tree.

use std::path::PathBuf;
use std::process::ExitCode;

use weft_codegen::{check, file_name, from_dir, render_file};

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("weft-codegen: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let mut mode = None;
    let mut dir = None;
    let mut out = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../api-versions/src/generated"
    ));
    let mut versions: Option<(u32, u32)> = None;
    let mut only: Option<String> = None;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--write" | "--check" | "--print" => {
                mode = Some(a.clone());
                dir = Some(PathBuf::from(
                    args.next().ok_or("missing header directory")?,
                ));
            }
            "--out" => out = PathBuf::from(args.next().ok_or("--out needs a directory")?),
            "--only" => only = Some(args.next().ok_or("--only needs net, collnet or rma")?),
            "--versions" => {
                let v = args.next().ok_or("--versions needs A-B")?;
                let (a, b) = v.split_once('-').unwrap_or((&v, &v));
                versions = Some((
                    a.parse().map_err(|_| "bad --versions")?,
                    b.parse().map_err(|_| "bad --versions")?,
                ));
            }
            "-h" | "--help" => {
                println!("usage: weft-codegen (--write|--check|--print) <NCCL header dir> [--versions A-B] [--only net|collnet|rma] [--out DIR]");
                return Ok(());
            }
            other => return Err(format!("unknown argument {other:?} (try --help)")),
        }
    }
    let (mode, dir) = (
        mode.ok_or("one of --write, --check, --print is required")?,
        dir.expect("set with mode"),
    );
    let (mut descs, h) = from_dir(&dir)?;
    descs.retain(|d| {
        versions.is_none_or(|(a, b)| (a..=b).contains(&d.version))
            && only.as_deref().is_none_or(|f| f == d.family)
    });
    for s in &h.supplied {
        eprintln!("weft-codegen: supplied {s}");
    }
    if descs.is_empty() {
        return Err(format!(
            "no ncclNet/ncclCollNet/ncclRma tables found in {}",
            dir.display()
        ));
    }
    match mode.as_str() {
        "--print" => {
            for d in &descs {
                println!("// {} v{}\n{d}", d.family, d.version);
            }
        }
        "--write" => {
            for d in &descs {
                let p = out.join(file_name(d));
                std::fs::write(&p, render_file(d, &h.source_of(&d.family)))
                    .map_err(|e| format!("{}: {e}", p.display()))?;
                eprintln!("weft-codegen: wrote {}", p.display());
            }
            write_mod(&out)?;
        }
        _ => {
            let n = check(&descs, &out)?;
            eprintln!("weft-codegen: {n} descriptor(s) match {}", dir.display());
        }
    }
    Ok(())
}

/// Regenerates `mod.rs` listing every descriptor file in `out`.
fn write_mod(out: &std::path::Path) -> Result<(), String> {
    let mut names: Vec<String> = std::fs::read_dir(out)
        .map_err(|e| format!("{}: {e}", out.display()))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".rs") && n != "mod.rs")
        .map(|n| n.trim_end_matches(".rs").to_owned())
        .collect();
    names.sort_by_key(|n| {
        let (fam, v) = n.rsplit_once("_v").unwrap_or((n, "0"));
        (fam.to_owned(), v.parse::<u32>().unwrap_or(0))
    });
    let mut text = format!(
        "{}\n//! The generated descriptors, one module per API version and family.\n\n",
        weft_codegen::GENERATED
    );
    for n in names {
        text.push_str(&format!("mod {n};\n"));
    }
    std::fs::write(out.join("mod.rs"), text).map_err(|e| e.to_string())
}
