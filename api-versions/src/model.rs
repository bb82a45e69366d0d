//! The descriptor language: what codegen writes and the proc macros read.
//!
//! ```text
//! family = net;                       // or collnet
//! version = 9;
//! symbol = ncclNetPlugin_v9;          // what NCCL dlsym()s
//! results { ncclSuccess = 0, ... }    // the codes this version's NCCL knows
//! struct ncclNetProperties_v9_t { name: *mut c_char, ... }
//! table ncclNet_v9_t { name: *const c_char, init: fn(logFunction: ncclDebugLogger_t) -> ncclResult_t,
//!                      optional makeVDevice: fn(...) -> ncclResult_t, ... }
//! ```
//!
//! `optional` marks a member NCCL checks for NULL before calling it (codegen
//! knows which); every other member is called unconditionally and a table
//! must serve it.
//!
//! Types are Rust spellings of the C types: `c_int`, `c_char`, `c_void`,
//! `c_uint`, `c_ulong`, `usize` (size_t), `u64`/`i64`/`u32`/`i32`/`u16`/`i16`,
//! `f32`, pointers, arrays, and names (structs of the descriptor, or NCCL's
//! enums and callback types: `ncclResult_t`, `ncclDataType_t`, `ncclRedOp_t`,
//! `ncclNetDeviceType`, `ncclDebugLogger_t`, `ncclProfilerCallback_t`).
//! A name that is not a struct of the descriptor is a C type the serving
//! crate defines (Weft: `plugin/src/adapter/ctypes.rs`).

use std::fmt;

use proc_macro2::{Ident, Span};
use syn::parse::{Parse, ParseStream};
use syn::{braced, parenthesized, Token};

/// A C type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ty {
    /// A primitive or a named type.
    Name(String),
    /// `*const T` / `*mut T`.
    Ptr {
        /// `*mut`.
        mutable: bool,
        /// Pointee.
        to: Box<Ty>,
    },
    /// `[T; N]`.
    Array(Box<Ty>, usize),
}

impl fmt::Display for Ty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ty::Name(n) => f.write_str(n),
            Ty::Ptr { mutable, to } => {
                write!(f, "*{} {to}", if *mutable { "mut" } else { "const" })
            }
            Ty::Array(t, n) => write!(f, "[{t}; {n}]"),
        }
    }
}

/// A struct field or function argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Field {
    /// C name.
    pub name: String,
    /// C type.
    pub ty: Ty,
}

/// A vtable member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Member {
    /// A data member (only `name`).
    Data(Field),
    /// A function pointer.
    Fn {
        /// Member name.
        name: String,
        /// NCCL checks it for NULL before calling it (a plugin may leave it NULL).
        optional: bool,
        /// Arguments in order.
        args: Vec<Field>,
        /// Return type.
        ret: Ty,
    },
}

impl Member {
    /// The member's name.
    pub fn name(&self) -> &str {
        match self {
            Member::Data(f) => &f.name,
            Member::Fn { name, .. } => name,
        }
    }
}

/// A struct with its members in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Struct {
    /// Name (version-normalised: `..._v<version>_t`).
    pub name: String,
    /// Fields in order.
    pub fields: Vec<Field>,
}

/// One API version of one family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    /// `net` or `collnet`.
    pub family: String,
    /// API version.
    pub version: u32,
    /// The symbol NCCL looks the table up by (`ncclNetPlugin_v9`).
    pub symbol: String,
    /// `ncclResult_t` codes.
    pub results: Vec<(String, i64)>,
    /// Every struct the table uses, dependencies first.
    pub structs: Vec<Struct>,
    /// The table struct's name.
    pub table_name: String,
    /// Its members in order.
    pub table: Vec<Member>,
}

impl Descriptor {
    /// The struct called `name`.
    pub fn struct_named(&self, name: &str) -> Option<&Struct> {
        self.structs.iter().find(|s| s.name == name)
    }
}

fn fields(f: &mut fmt::Formatter<'_>, fs: &[Field], sep: &str) -> fmt::Result {
    for (i, x) in fs.iter().enumerate() {
        if i > 0 {
            f.write_str(sep)?;
        }
        write!(f, "{}: {}", x.name, x.ty)?;
    }
    Ok(())
}

impl fmt::Display for Descriptor {
    /// The descriptor body, one item per line (stable: codegen compares text).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "family = {};", self.family)?;
        writeln!(f, "version = {};", self.version)?;
        writeln!(f, "symbol = {};", self.symbol)?;
        write!(f, "results {{")?;
        for (i, (n, v)) in self.results.iter().enumerate() {
            write!(f, "{}{n} = {v}", if i > 0 { ", " } else { " " })?;
        }
        writeln!(f, " }}")?;
        for s in &self.structs {
            writeln!(f, "struct {} {{", s.name)?;
            for x in &s.fields {
                writeln!(f, "    {}: {},", x.name, x.ty)?;
            }
            writeln!(f, "}}")?;
        }
        writeln!(f, "table {} {{", self.table_name)?;
        for m in &self.table {
            match m {
                Member::Data(x) => writeln!(f, "    {}: {},", x.name, x.ty)?,
                Member::Fn {
                    name,
                    optional,
                    args,
                    ret,
                } => {
                    let opt = if *optional { "optional " } else { "" };
                    write!(f, "    {opt}{name}: fn(")?;
                    fields(f, args, ", ")?;
                    writeln!(f, ") -> {ret},")?;
                }
            }
        }
        writeln!(f, "}}")
    }
}

// ---- parsing (the proc macros read descriptors with this)

fn parse_ty(input: ParseStream) -> syn::Result<Ty> {
    if input.peek(Token![*]) {
        input.parse::<Token![*]>()?;
        let mutable = if input.peek(Token![mut]) {
            input.parse::<Token![mut]>()?;
            true
        } else {
            input.parse::<Token![const]>()?;
            false
        };
        return Ok(Ty::Ptr {
            mutable,
            to: Box::new(parse_ty(input)?),
        });
    }
    if input.peek(syn::token::Bracket) {
        let content;
        syn::bracketed!(content in input);
        let t = parse_ty(&content)?;
        content.parse::<Token![;]>()?;
        let n: syn::LitInt = content.parse()?;
        return Ok(Ty::Array(Box::new(t), n.base10_parse()?));
    }
    let id: Ident = input.parse()?;
    Ok(Ty::Name(id.to_string()))
}

/// Fields and the span of each name.
fn parse_fields(input: ParseStream) -> syn::Result<(Vec<Field>, Vec<Span>)> {
    let mut out = Vec::new();
    let mut spans = Vec::new();
    while !input.is_empty() {
        let name: Ident = input.parse()?;
        input.parse::<Token![:]>()?;
        spans.push(name.span());
        out.push(Field {
            name: name.to_string(),
            ty: parse_ty(input)?,
        });
        if input.is_empty() {
            break;
        }
        input.parse::<Token![,]>()?;
    }
    Ok((out, spans))
}

/// A parsed descriptor together with the span of each member name, so the
/// macros report errors on the right token.
#[derive(Debug, Clone)]
pub struct Parsed {
    /// The descriptor.
    pub desc: Descriptor,
    /// Spans of the table members, in order.
    pub member_spans: Vec<Span>,
    /// Spans of struct fields, by (struct, field).
    pub field_spans: Vec<(String, String, Span)>,
}

fn kw(input: ParseStream, word: &str) -> syn::Result<()> {
    let id: Ident = input.parse()?;
    if id != word {
        return Err(syn::Error::new(id.span(), format!("expected `{word}`")));
    }
    Ok(())
}

impl Parse for Parsed {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        kw(input, "family")?;
        input.parse::<Token![=]>()?;
        let family: Ident = input.parse()?;
        input.parse::<Token![;]>()?;
        kw(input, "version")?;
        input.parse::<Token![=]>()?;
        let version: syn::LitInt = input.parse()?;
        input.parse::<Token![;]>()?;
        kw(input, "symbol")?;
        input.parse::<Token![=]>()?;
        let symbol: Ident = input.parse()?;
        input.parse::<Token![;]>()?;
        kw(input, "results")?;
        let content;
        braced!(content in input);
        let mut results = Vec::new();
        while !content.is_empty() {
            let n: Ident = content.parse()?;
            content.parse::<Token![=]>()?;
            let neg = content.peek(Token![-]);
            if neg {
                content.parse::<Token![-]>()?;
            }
            let v: syn::LitInt = content.parse()?;
            let v: i64 = v.base10_parse()?;
            results.push((n.to_string(), if neg { -v } else { v }));
            if !content.is_empty() {
                content.parse::<Token![,]>()?;
            }
        }
        let mut structs = Vec::new();
        let mut field_spans = Vec::new();
        while input.peek(Token![struct]) {
            input.parse::<Token![struct]>()?;
            let name: Ident = input.parse()?;
            let content;
            braced!(content in input);
            let (fs, spans) = parse_fields(&content)?;
            for (f, span) in fs.iter().zip(spans) {
                field_spans.push((name.to_string(), f.name.clone(), span));
            }
            structs.push(Struct {
                name: name.to_string(),
                fields: fs,
            });
        }
        kw(input, "table")?;
        let table_name: Ident = input.parse()?;
        let content;
        braced!(content in input);
        let mut table = Vec::new();
        let mut member_spans = Vec::new();
        while !content.is_empty() {
            let mut name: Ident = content.parse()?;
            let optional = name == "optional" && !content.peek(Token![:]);
            if optional {
                name = content.parse()?;
            }
            content.parse::<Token![:]>()?;
            member_spans.push(name.span());
            if content.peek(Token![fn]) {
                content.parse::<Token![fn]>()?;
                let a;
                parenthesized!(a in content);
                let (args, _) = parse_fields(&a)?;
                content.parse::<Token![->]>()?;
                let ret = parse_ty(&content)?;
                table.push(Member::Fn {
                    name: name.to_string(),
                    optional,
                    args,
                    ret,
                });
            } else {
                table.push(Member::Data(Field {
                    name: name.to_string(),
                    ty: parse_ty(&content)?,
                }));
            }
            if !content.is_empty() {
                content.parse::<Token![,]>()?;
            }
        }
        Ok(Parsed {
            desc: Descriptor {
                family: family.to_string(),
                version: version.base10_parse()?,
                symbol: symbol.to_string(),
                results,
                structs,
                table_name: table_name.to_string(),
                table,
            },
            member_spans,
            field_spans,
        })
    }
}

/// Parses a descriptor body from text.
pub fn parse_str(s: &str) -> syn::Result<Descriptor> {
    syn::parse_str::<Parsed>(s).map(|p| p.desc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_and_parse_round_trip() {
        let d = Descriptor {
            family: "net".into(),
            version: 9,
            symbol: "ncclNetPlugin_v9".into(),
            results: vec![("ncclSuccess".into(), 0), ("ncclSystemError".into(), 2)],
            structs: vec![Struct {
                name: "ncclNetVDeviceProps_v9_t".into(),
                fields: vec![
                    Field {
                        name: "ndevs".into(),
                        ty: Ty::Name("c_int".into()),
                    },
                    Field {
                        name: "devs".into(),
                        ty: Ty::Array(Box::new(Ty::Name("c_int".into())), 4),
                    },
                ],
            }],
            table_name: "ncclNet_v9_t".into(),
            table: vec![
                Member::Data(Field {
                    name: "name".into(),
                    ty: Ty::Ptr {
                        mutable: false,
                        to: Box::new(Ty::Name("c_char".into())),
                    },
                }),
                Member::Fn {
                    name: "test".into(),
                    optional: false,
                    args: vec![
                        Field {
                            name: "request".into(),
                            ty: Ty::Ptr {
                                mutable: true,
                                to: Box::new(Ty::Name("c_void".into())),
                            },
                        },
                        Field {
                            name: "done".into(),
                            ty: Ty::Ptr {
                                mutable: true,
                                to: Box::new(Ty::Name("c_int".into())),
                            },
                        },
                    ],
                    ret: Ty::Name("ncclResult_t".into()),
                },
            ],
        };
        let text = d.to_string();
        assert_eq!(parse_str(&text).unwrap(), d, "{text}");
    }
}
