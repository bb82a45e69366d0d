//! weft-codegen: NCCL headers -> Weft version descriptors.
//!
//! bindgen (libclang) reads the headers; its Rust output is parsed with syn;
//! every `ncclNet_vN_t` / `ncclCollNet_vN_t` / `ncclRma_vN_t` table becomes a [`Descriptor`]
//! with its members in order, every struct it uses (transitively), and the
//! `ncclResult_t` codes that version's NCCL knows.

pub mod headers;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use weft_api::model::{Descriptor, Field, Member, Struct, Ty};

/// Names kept as names (NCCL enums and callback types), never expanded.
pub const OPAQUE: &[&str] = &[
    "ncclResult_t",
    "ncclDataType_t",
    "ncclRedOp_t",
    "ncclNetDeviceType",
    "ncclDebugLogger_t",
    "ncclProfilerCallback_t",
];

/// Members NCCL checks for NULL before calling (so a plugin may leave them
/// NULL), per family, with where NCCL's source checks each. Every other
/// member, and every member a future NCCL adds until someone reads how NCCL
/// calls it and lists it here, is mandatory: a table must serve it.
pub const OPTIONAL: &[(&[&str], &str, &str)] = &[
    (
        NET,
        "getDeviceMr",
        "transport/net.cc: `if (... ncclNet->getDeviceMr)`",
    ),
    (
        NET,
        "irecvConsumed",
        "transport/net.cc: `if (ncclNet->irecvConsumed)`",
    ),
    (
        NET,
        "makeVDevice",
        "graph/topo.cc: `net->makeVDevice == NULL` uses physical devices",
    ),
    (
        NET,
        "setNetAttr",
        "transport/net.cc: `if (!ncclNet->setNetAttr) return`",
    ),
    (
        NET,
        "regMrDmaBuf",
        "init.cc: `comm->ncclNet->regMrDmaBuf == NULL` disables DMA-BUF",
    ),
    (
        NET,
        "iallgather",
        "graph/tuning.cc: `!comm->ncclCollNet->iallgather`",
    ),
    (
        NET,
        "ireducescatter",
        "graph/tuning.cc: CollNet ReduceScatter needs `ireducescatter`",
    ),
    (
        RMA,
        "iflush",
        "gin/gin_host_proxy.cc: `if (!rmaBackend->iflush)` (the RMA proxy never calls it)",
    ),
    (
        RMA,
        "rmaProgress",
        "gin/gin_host_proxy.cc and rma/rma_proxy_progress.cc: `if (... ->rmaProgress)`",
    ),
    (
        RMA,
        "ginProgress",
        "plugin/rma/rma_v13.cc: v13's ginProgress becomes rmaProgress, checked as that is",
    ),
    (
        RMA,
        "queryLastError",
        "gin/gin_host_proxy.cc: `if (... rmaBackend->queryLastError)`",
    ),
];

/// The families [`OPTIONAL`] names.
const NET: &[&str] = &["net", "collnet"];
const RMA: &[&str] = &["rma"];

/// Whether NCCL checks member `name` of a `family` table for NULL.
pub fn is_optional(family: &str, name: &str) -> bool {
    OPTIONAL
        .iter()
        .any(|(fams, n, _)| *n == name && fams.contains(&family))
}

/// Plugin-facing result codes and the NCCL release that introduced each
/// (reference §3.4: the plugin `err.h` defines 0-6; `ncclRemoteError` came
/// with 2.13). Codes NCCL's core keeps to itself are not plugin results.
const RESULT_SINCE: &[(&str, (u32, u32))] = &[
    ("ncclSuccess", (2, 0)),
    ("ncclUnhandledCudaError", (2, 0)),
    ("ncclSystemError", (2, 0)),
    ("ncclInternalError", (2, 0)),
    ("ncclInvalidArgument", (2, 0)),
    ("ncclInvalidUsage", (2, 0)),
    ("ncclRemoteError", (2, 13)),
];

/// The first NCCL release that loads each API version (reference §4.3):
/// net and CollNet v5..v12, RMA v13..v16 (v13 from 2.30.3, v14 from
/// 2.30.7; the numbers do not overlap).
pub fn first_release(version: u32) -> Option<(u32, u32)> {
    Some(match version {
        5 => (2, 12),
        6 => (2, 13),
        7 => (2, 19),
        8 => (2, 20),
        9 => (2, 24),
        10 => (2, 26),
        11 => (2, 28),
        12 => (2, 30),
        13 | 14 => (2, 30),
        15 => (2, 31),
        16 => (2, 32),
        _ => return None,
    })
}

fn ty_of(t: &syn::Type, aliases: &HashMap<String, syn::Type>) -> Result<Ty, String> {
    Ok(match t {
        syn::Type::Ptr(p) => Ty::Ptr {
            mutable: p.mutability.is_some(),
            to: Box::new(ty_of(&p.elem, aliases)?),
        },
        syn::Type::Array(a) => {
            let n = match &a.len {
                syn::Expr::Lit(syn::ExprLit {
                    lit: syn::Lit::Int(i),
                    ..
                }) => i.base10_parse::<usize>().map_err(|e| e.to_string())?,
                other => return Err(format!("array length {}", quote::quote!(#other))),
            };
            Ty::Array(Box::new(ty_of(&a.elem, aliases)?), n)
        }
        syn::Type::Path(p) => {
            let last = p
                .path
                .segments
                .last()
                .ok_or("empty path")?
                .ident
                .to_string();
            if OPAQUE.contains(&last.as_str()) {
                Ty::Name(last)
            } else if let Some(target) = aliases.get(&last) {
                // Typedefs of primitives or of other structs resolve; struct
                // typedef chains end at the struct bindgen defined.
                match ty_of(target, aliases)? {
                    Ty::Name(n) if n.starts_with("nccl") => Ty::Name(n),
                    other => other,
                }
            } else {
                Ty::Name(last)
            }
        }
        other => return Err(format!("unsupported type {}", quote::quote!(#other))),
    })
}

/// `Foo_v7_t` -> `Foo_v9_t` for a v9 descriptor: one name per layout, so
/// descriptors from different sources compare equal.
fn normalise(name: &str, version: u32) -> String {
    if let Some(stem) = name.strip_suffix("_t") {
        if let Some(pos) = stem.rfind("_v") {
            if stem[pos + 2..].chars().all(|c| c.is_ascii_digit()) && pos + 2 < stem.len() {
                return format!("{}_v{version}_t", &stem[..pos]);
            }
        }
    }
    name.to_owned()
}

/// The symbol NCCL looks table `ncclNet_v9_t` up by: `ncclNetPlugin_v9`
/// (NCCL dlsym()s `<table>Plugin_v<N>`: src/plugin/net/net_vN.cc).
fn symbol_of(table: &str, version: u32) -> String {
    let stem = table
        .strip_suffix(&format!("_v{version}_t"))
        .unwrap_or(table);
    format!("{stem}Plugin_v{version}")
}

fn rename(t: &Ty, version: u32) -> Ty {
    match t {
        Ty::Name(n) => Ty::Name(normalise(n, version)),
        Ty::Ptr { mutable, to } => Ty::Ptr {
            mutable: *mutable,
            to: Box::new(rename(to, version)),
        },
        Ty::Array(t, n) => Ty::Array(Box::new(rename(t, version)), *n),
    }
}

/// Extracts every table descriptor from bindgen's output.
pub fn extract(rust: &str) -> Result<Vec<Descriptor>, String> {
    let file = syn::parse_file(rust).map_err(|e| format!("parsing bindgen output: {e}"))?;
    let mut aliases: HashMap<String, syn::Type> = HashMap::new();
    let mut structs: HashMap<String, Vec<(String, syn::Type)>> = HashMap::new();
    let mut consts: BTreeMap<String, i64> = BTreeMap::new();
    for item in &file.items {
        match item {
            syn::Item::Type(t) => {
                aliases.insert(t.ident.to_string(), (*t.ty).clone());
            }
            syn::Item::Struct(s) => {
                if let syn::Fields::Named(n) = &s.fields {
                    let fs = n
                        .named
                        .iter()
                        .map(|f| {
                            (
                                f.ident.as_ref().map(|i| i.to_string()).unwrap_or_default(),
                                f.ty.clone(),
                            )
                        })
                        .collect();
                    structs.insert(s.ident.to_string(), fs);
                }
            }
            syn::Item::Const(c) => {
                if let syn::Expr::Lit(syn::ExprLit {
                    lit: syn::Lit::Int(i),
                    ..
                }) = &*c.expr
                {
                    if let Ok(v) = i.base10_parse::<i64>() {
                        consts.insert(c.ident.to_string(), v);
                    }
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    // Tables are structs, or typedefs of one (RMA v13 is GIN v13's table).
    let mut tables: Vec<(&String, &Vec<(String, syn::Type)>)> = structs.iter().collect();
    for name in aliases.keys() {
        if name.starts_with("ncclRma_v") && !structs.contains_key(name) {
            if let Some(fields) = find_struct(name, &structs, &aliases) {
                tables.push((name, fields));
            }
        }
    }
    for (name, fields) in tables {
        let (family, rest) = if let Some(r) = name.strip_prefix("ncclNet_v") {
            ("net", r)
        } else if let Some(r) = name.strip_prefix("ncclCollNet_v") {
            ("collnet", r)
        } else if let Some(r) = name.strip_prefix("ncclRma_v") {
            ("rma", r)
        } else {
            continue;
        };
        let Some(version) = rest.strip_suffix("_t").and_then(|v| v.parse::<u32>().ok()) else {
            continue;
        };
        if first_release(version).is_none() {
            // v2..v4 are older than NCCL 2.12; newer ones need a mapping first.
            if version < 5 {
                continue;
            }
        }
        let mut table = Vec::new();
        let mut used: Vec<String> = Vec::new();
        let mut orig: HashMap<String, String> = HashMap::new();
        for (fname, fty) in fields {
            let m = match fn_sig(fty) {
                Some((args, ret)) => {
                    let mut a = Vec::new();
                    for (i, (an, at)) in args.iter().enumerate() {
                        let raw = ty_of(at, &aliases)?;
                        originals(&raw, version, &mut orig);
                        let ty = rename(&raw, version);
                        collect(&ty, &mut used);
                        a.push(Field {
                            name: an.clone().unwrap_or_else(|| format!("arg{i}")),
                            ty,
                        });
                    }
                    Member::Fn {
                        name: fname.clone(),
                        optional: is_optional(family, fname),
                        args: a,
                        ret: ty_of(&ret, &aliases)?,
                    }
                }
                None => Member::Data(Field {
                    name: fname.clone(),
                    ty: ty_of(fty, &aliases)?,
                }),
            };
            table.push(m);
        }
        // Structs used, with their own dependencies first.
        let mut defs: Vec<Struct> = Vec::new();
        let mut i = 0;
        while i < used.len() {
            let n = used[i].clone();
            i += 1;
            let real = orig.get(&n).cloned().unwrap_or_else(|| n.clone());
            let raw = find_struct(&real, &structs, &aliases).ok_or_else(|| {
                format!("{family} v{version}: struct {real} not found in the headers")
            })?;
            let mut fs = Vec::new();
            for (fname, fty) in raw {
                let rawt = ty_of(fty, &aliases)?;
                originals(&rawt, version, &mut orig);
                let ty = rename(&rawt, version);
                collect(&ty, &mut used);
                fs.push(Field {
                    name: fname.clone(),
                    ty,
                });
            }
            defs.push(Struct {
                name: n,
                fields: fs,
            });
        }
        defs.reverse();
        let release = first_release(version).unwrap_or((u32::MAX, 0));
        let results = RESULT_SINCE
            .iter()
            .filter(|(_, since)| *since <= release)
            .filter_map(|(n, _)| consts.get(*n).map(|v| ((*n).to_owned(), *v)))
            .collect();
        out.push(Descriptor {
            family: family.to_owned(),
            version,
            symbol: symbol_of(name, version),
            results,
            structs: defs,
            table_name: name.clone(),
            table,
        });
    }
    out.sort_by(|a, b| (a.family.as_str(), a.version).cmp(&(b.family.as_str(), b.version)));
    Ok(out)
}

/// Records which real (header) name each normalised struct name came from.
fn originals(t: &Ty, version: u32, map: &mut HashMap<String, String>) {
    match t {
        Ty::Name(n) if n.starts_with("nccl") && !OPAQUE.contains(&n.as_str()) => {
            map.entry(normalise(n, version))
                .or_insert_with(|| n.clone());
        }
        Ty::Ptr { to, .. } => originals(to, version, map),
        Ty::Array(t, _) => originals(t, version, map),
        _ => {}
    }
}

fn collect(t: &Ty, used: &mut Vec<String>) {
    match t {
        Ty::Name(n)
            if n.starts_with("nccl") && !OPAQUE.contains(&n.as_str()) && !used.contains(n) =>
        {
            used.push(n.clone());
        }
        Ty::Ptr { to, .. } => collect(to, used),
        Ty::Array(t, _) => collect(t, used),
        _ => {}
    }
}

/// The struct a header name denotes, following typedef chains.
fn find_struct<'a>(
    name: &str,
    structs: &'a HashMap<String, Vec<(String, syn::Type)>>,
    aliases: &HashMap<String, syn::Type>,
) -> Option<&'a Vec<(String, syn::Type)>> {
    let mut n = name.to_owned();
    for _ in 0..8 {
        if let Some(s) = structs.get(&n) {
            return Some(s);
        }
        match aliases.get(&n) {
            Some(syn::Type::Path(p)) => n = p.path.segments.last()?.ident.to_string(),
            _ => return None,
        }
    }
    None
}

/// `Option<unsafe extern "C" fn(args) -> ret>` -> (args, ret).
/// A function pointer's (named) arguments and return type.
type Sig = (Vec<(Option<String>, syn::Type)>, syn::Type);

fn fn_sig(t: &syn::Type) -> Option<Sig> {
    let syn::Type::Path(p) = t else { return None };
    let seg = p.path.segments.last()?;
    if seg.ident != "Option" {
        return None;
    }
    let syn::PathArguments::AngleBracketed(a) = &seg.arguments else {
        return None;
    };
    let syn::GenericArgument::Type(syn::Type::BareFn(f)) = a.args.first()? else {
        return None;
    };
    let args = f
        .inputs
        .iter()
        .map(|i| (i.name.as_ref().map(|(n, _)| n.to_string()), i.ty.clone()))
        .collect();
    let ret = match &f.output {
        syn::ReturnType::Type(_, t) => (**t).clone(),
        syn::ReturnType::Default => syn::parse_quote!(c_void),
    };
    Some((args, ret))
}

/// File name of a descriptor.
pub fn file_name(d: &Descriptor) -> String {
    format!("{}_v{}.rs", d.family, d.version)
}

/// The first line of every descriptor file.
pub const GENERATED: &str = "// @generated by weft-codegen: do not edit; regenerate with `cargo run -p weft-codegen -- --write <NCCL headers>`.";

/// The whole descriptor file: header, source, then a macro that hands the
/// body to a callback macro.
pub fn render_file(d: &Descriptor, source: &str) -> String {
    let body: String = d
        .to_string()
        .lines()
        .map(|l| format!("            {l}\n"))
        .collect();
    format!(
        "{GENERATED}\n// Source: {source}\n\n/// `{table}` (NCCL {rel}+), generated from NCCL's headers.\n#[macro_export]\nmacro_rules! {fam}_v{v} {{\n    ($($cb:ident)::+ $({{ $($map:tt)* }})?) => {{\n        $($cb)::+! {{\n            mapping {{ $($($map)*)? }}\n{body}        }}\n    }};\n}}\n",
        table = d.table_name,
        rel = first_release(d.version).map_or("?".into(), |(a, b)| format!("{a}.{b}")),
        fam = d.family,
        v = d.version,
    )
}

/// The descriptor body of a file (everything between `mapping` and the end).
pub fn body_of_file(text: &str) -> Option<String> {
    let start = text.find("mapping {")?;
    let after = &text[start..];
    let first_nl = after.find('\n')?;
    let body = &after[first_nl + 1..];
    let end = body.rfind("        }\n    };")?;
    Some(
        body[..end]
            .lines()
            .map(|l| l.strip_prefix("            ").unwrap_or(l))
            .collect::<Vec<_>>()
            .join("\n")
            + "\n",
    )
}

/// Reads a header directory and returns its descriptors (and what codegen
/// supplied for missing includes).
pub fn from_dir(dir: &Path) -> Result<(Vec<Descriptor>, headers::Headers), String> {
    let stub = std::env::temp_dir().join(format!(
        "weft-codegen-{}-{}",
        std::process::id(),
        dir.to_string_lossy().len()
    ));
    let h = headers::locate(dir, &stub)?;
    let rust = headers::bindgen(&h)?;
    let _ = std::fs::remove_dir_all(&stub);
    Ok((extract(&rust)?, h))
}

/// Compares fresh descriptors with the files in `out`; the first difference,
/// naming the member, is the error.
pub fn check(fresh: &[Descriptor], out: &Path) -> Result<usize, String> {
    let mut n = 0;
    for d in fresh {
        let path = out.join(file_name(d));
        let text = std::fs::read_to_string(&path).map_err(|e| {
            format!(
                "{}: {e} (run weft-codegen --write to create it)",
                path.display()
            )
        })?;
        let body = body_of_file(&text)
            .ok_or_else(|| format!("{}: not a descriptor file", path.display()))?;
        let committed =
            weft_api::model::parse_str(&body).map_err(|e| format!("{}: {e}", path.display()))?;
        if let Some(diff) = first_difference(&committed, d) {
            return Err(format!(
                "{} v{}: {diff} ({})",
                d.family,
                d.version,
                path.display()
            ));
        }
        n += 1;
    }
    Ok(n)
}

/// Names the first member, struct field or result that differs.
pub fn first_difference(old: &Descriptor, new: &Descriptor) -> Option<String> {
    if old.results != new.results {
        return Some(format!(
            "result codes differ: committed {:?}, headers {:?}",
            old.results, new.results
        ));
    }
    for (i, (a, b)) in old.table.iter().zip(&new.table).enumerate() {
        if a != b {
            return Some(format!(
                "member #{} `{}` differs: committed `{a:?}`, headers `{b:?}`",
                i + 1,
                a.name()
            ));
        }
    }
    if old.table.len() != new.table.len() {
        let extra = if new.table.len() > old.table.len() {
            &new.table[old.table.len()]
        } else {
            &old.table[new.table.len()]
        };
        return Some(format!(
            "member count differs ({} committed, {} in headers), first unmatched member `{}`",
            old.table.len(),
            new.table.len(),
            extra.name()
        ));
    }
    for s in &new.structs {
        match old.struct_named(&s.name) {
            None => {
                return Some(format!(
                    "struct {} is missing from the committed descriptor",
                    s.name
                ))
            }
            Some(o) => {
                for (a, b) in o.fields.iter().zip(&s.fields) {
                    if a != b {
                        return Some(format!(
                            "struct {} field `{}` differs: committed `{}`, headers `{}`",
                            s.name, a.name, a.ty, b.ty
                        ));
                    }
                }
                if o.fields.len() != s.fields.len() {
                    return Some(format!(
                        "struct {} has {} fields committed, {} in headers",
                        s.name,
                        o.fields.len(),
                        s.fields.len()
                    ));
                }
            }
        }
    }
    (old != new).then(|| "descriptors differ (struct order)".to_owned())
}

/// A C spelling of a descriptor type, for synthetic headers.
fn c_ty(t: &Ty) -> String {
    match t {
        Ty::Name(n) => match n.as_str() {
            "c_int" => "int",
            "c_uint" => "unsigned int",
            "c_char" => "char",
            "c_void" => "void",
            "c_ulong" => "unsigned long",
            "c_long" => "long",
            "usize" => "size_t",
            "u64" => "uint64_t",
            "i64" => "int64_t",
            "u32" => "uint32_t",
            "i32" => "int32_t",
            "u16" => "uint16_t",
            "i16" => "int16_t",
            "f32" => "float",
            "bool" => "bool",
            other => other,
        }
        .to_owned(),
        Ty::Ptr { mutable: true, to } => format!("{}*", c_ty(to)),
        Ty::Ptr { mutable: false, to } => format!("const {}*", c_ty(to)),
        Ty::Array(t, _) => c_ty(t),
    }
}

fn c_decl(name: &str, t: &Ty) -> String {
    match t {
        Ty::Array(inner, n) => format!("{} {name}[{n}]", c_ty(inner)),
        other => format!("{} {name}", c_ty(other)),
    }
}

/// Writes a descriptor back out as an installed-layout header set
/// (`nccl.h` + `nccl_net.h`) in `dir`. The text is Weft's own rendering of
/// its descriptor, used to test codegen on APIs NCCL has not published.
pub fn write_synthetic_headers(d: &Descriptor, dir: &Path) -> std::io::Result<()> {
    let results: Vec<String> = d
        .results
        .iter()
        .map(|(n, v)| format!("{n} = {v}"))
        .collect();
    let nccl_h = format!(
        "/* synthetic: written by weft-codegen from a Weft descriptor */\n#include <stdbool.h>\n#include <stddef.h>\n#include <stdint.h>\n\
         typedef enum {{ {} }} ncclResult_t;\n",
        results.join(", ")
    );
    let mut net = String::from(
        "/* synthetic: written by weft-codegen from a Weft descriptor */\n#include \"nccl.h\"\n\
         typedef enum {NCCL_LOG_NONE=0, NCCL_LOG_WARN=2, NCCL_LOG_INFO=3, NCCL_LOG_TRACE=5} ncclDebugLogLevel;\n\
         typedef void (*ncclDebugLogger_t)(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...);\n\
         typedef ncclResult_t (*ncclProfilerCallback_t)(void** eHandle, int type, void* pHandle, int64_t pluginId, void* extData);\n\
         typedef enum {NCCL_NET_DEVICE_HOST=0, NCCL_NET_DEVICE_UNPACK=1} ncclNetDeviceType;\n",
    );
    for s in &d.structs {
        net.push_str("typedef struct {\n");
        for f in &s.fields {
            net.push_str(&format!("  {};\n", c_decl(&f.name, &f.ty)));
        }
        net.push_str(&format!("}} {};\n", s.name));
    }
    net.push_str("typedef struct {\n");
    for m in &d.table {
        match m {
            Member::Data(f) => net.push_str(&format!("  {};\n", c_decl(&f.name, &f.ty))),
            Member::Fn {
                name, args, ret, ..
            } => {
                let a: Vec<String> = args
                    .iter()
                    .map(|f| c_decl(f.name.trim_end_matches('_'), &f.ty))
                    .collect();
                net.push_str(&format!("  {} (*{name})({});\n", c_ty(ret), a.join(", ")));
            }
        }
    }
    net.push_str(&format!("}} {};\n", d.table_name));
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("nccl.h"), nccl_h)?;
    std::fs::write(dir.join("nccl_net.h"), net)
}

/// A copy of `d` as API version `to`: every `_v<old>_t` name renamed.
pub fn as_version(d: &Descriptor, to: u32) -> Descriptor {
    let mut out = d.clone();
    out.version = to;
    out.table_name = normalise(&d.table_name, to);
    out.symbol = symbol_of(&out.table_name, to);
    for s in &mut out.structs {
        s.name = normalise(&s.name, to);
        for f in &mut s.fields {
            f.ty = rename(&f.ty, to);
        }
    }
    for m in &mut out.table {
        match m {
            Member::Data(f) => f.ty = rename(&f.ty, to),
            Member::Fn { args, .. } => {
                for a in args {
                    a.ty = rename(&a.ty, to);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn committed(name: &str) -> Descriptor {
        let path = format!(
            "{}/../api-versions/src/generated/{name}.rs",
            env!("CARGO_MANIFEST_DIR")
        );
        let text = std::fs::read_to_string(&path).unwrap();
        weft_api::model::parse_str(&body_of_file(&text).unwrap()).unwrap()
    }

    #[test]
    fn committed_files_round_trip() {
        for (fam, versions) in [("net", 5..=12), ("collnet", 5..=12), ("rma", 13..=16)] {
            for v in versions {
                let d = committed(&format!("{fam}_v{v}"));
                assert_eq!((d.family.as_str(), d.version), (fam, v));
                let again = weft_api::model::parse_str(&d.to_string()).unwrap();
                assert_eq!(again, d);
                assert!(first_difference(&d, &again).is_none());
            }
        }
    }

    #[test]
    fn a_changed_member_is_named() {
        let d = committed("net_v9");
        let mut changed = d.clone();
        if let Member::Fn { args, .. } = &mut changed.table[10] {
            args[2].ty = Ty::Name("c_int".into());
        }
        let diff = first_difference(&d, &changed).unwrap();
        assert!(diff.contains("member #11 `isend`"), "{diff}");
        let mut shorter = d.clone();
        shorter.table.pop();
        let diff = first_difference(&shorter, &d).unwrap();
        assert!(diff.contains("makeVDevice"), "{diff}");
        let mut field = d.clone();
        field
            .structs
            .iter_mut()
            .find(|s| s.name == "ncclNetProperties_v9_t")
            .unwrap()
            .fields[6]
            .ty = Ty::Name("u64".into());
        let diff = first_difference(&d, &field).unwrap();
        assert!(
            diff.contains("ncclNetProperties_v9_t field `speed`"),
            "{diff}"
        );
    }

    #[test]
    fn names_are_normalised_per_version() {
        assert_eq!(
            normalise("ncclNetProperties_v6_t", 5),
            "ncclNetProperties_v5_t"
        );
        assert_eq!(
            normalise("ncclNetDeviceHandle_v7_t", 9),
            "ncclNetDeviceHandle_v9_t"
        );
        assert_eq!(normalise("ncclResult_t", 9), "ncclResult_t");
    }

    #[test]
    fn file_text_round_trips() {
        let d = committed("collnet_v11");
        let text = render_file(&d, "test");
        assert!(text.starts_with(GENERATED));
        assert_eq!(
            weft_api::model::parse_str(&body_of_file(&text).unwrap()).unwrap(),
            d
        );
    }
}
