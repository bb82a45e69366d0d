//! `export!`: one NCCL plugin table from one version descriptor.
//!
//! ```text
//! weft_api::net_v5!(weft_macros::export);                     // every member served
//! weft_api::net_v9!(weft_macros::export { null = [getDeviceMr, irecvConsumed] });
//! weft_api::net_v99!(weft_macros::export { props { newField = 0 } });
//! ```
//!
//! From the descriptor it emits a module `net_vN` / `collnet_vN` with the
//! `#[repr(C)]` structs, one `extern "C"` adapter per member and the exported
//! `#[unsafe(no_mangle)] static` named by the descriptor's `symbol`. An
//! adapter only converts and forwards: every C argument goes, by its C name,
//! into the core's argument struct for that member
//! (`<core>::<family>::args::<member>`; arguments a version lacks take the
//! core's defaults), the core function runs under `<core>::boundary` (panics
//! caught, errors logged and mapped to the codes this version's NCCL knows,
//! `<core>::Results::from_codes`).
//!
//! The macro knows nothing the core serves: a C type is
//! `<core>::ctypes::<name>` (unless the descriptor defines the struct), a
//! props field `f` is `<core>::props::f(&Properties)` (a nested struct's field
//! `s.g`: `<core>::props::s::g`), a data member is
//! `<core>::<family>::data::<name>`, and every member the mapping does not
//! leave `null` is a call of `<core>::<family>::<member>`, each on the span
//! of its declaration in the descriptor, so rustc's "cannot find ..." names
//! what the core lacks where it is declared. Only members the descriptor
//! marks `optional` (NCCL checks them for NULL) may be mapped `null`; which
//! ones Weft leaves NULL is said where the tables are exported
//! (plugin/src/lib.rs). The one member it knows by name is `getProperties`,
//! whose props struct it fills field by field.

use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as Tokens};
use quote::{format_ident, quote, quote_spanned};
use syn::parse::{Parse, ParseStream};
use syn::{braced, bracketed, Ident, Path, Token};
use weft_api::model::{Descriptor, Member, Parsed, Ty};

/// The hand-written part of an invocation.
struct Mapping {
    core: Path,
    null: Vec<Ident>,
    props: Vec<(Ident, syn::Expr)>,
}

impl Parse for Mapping {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let mut m = Mapping {
            core: syn::parse_quote!(crate::adapter),
            null: Vec::new(),
            props: Vec::new(),
        };
        while !input.is_empty() {
            let key: Ident = input.parse()?;
            match key.to_string().as_str() {
                "core" => {
                    input.parse::<Token![=]>()?;
                    m.core = input.parse()?;
                }
                "null" => {
                    input.parse::<Token![=]>()?;
                    let c;
                    bracketed!(c in input);
                    m.null = c
                        .parse_terminated(Ident::parse, Token![,])?
                        .into_iter()
                        .collect();
                }
                "props" => {
                    let c;
                    braced!(c in input);
                    while !c.is_empty() {
                        let f: Ident = c.parse()?;
                        c.parse::<Token![=]>()?;
                        let e: syn::Expr = c.parse()?;
                        m.props.push((f, e));
                        if !c.is_empty() {
                            c.parse::<Token![,]>()?;
                        }
                    }
                }
                other => {
                    return Err(syn::Error::new(
                        key.span(),
                        format!("unknown mapping key `{other}` (expected core, null, props)"),
                    ))
                }
            }
            if input.peek(Token![;]) {
                input.parse::<Token![;]>()?;
            }
        }
        Ok(m)
    }
}

struct Input {
    mapping: Mapping,
    parsed: Parsed,
}

impl Parse for Input {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let kw: Ident = input.parse()?;
        if kw != "mapping" {
            return Err(syn::Error::new(
                kw.span(),
                "expected `mapping { ... }` (invoke through a weft_api descriptor macro)",
            ));
        }
        let c;
        braced!(c in input);
        let mapping: Mapping = c.parse()?;
        let parsed: Parsed = input.parse()?;
        Ok(Input { mapping, parsed })
    }
}

/// Emits a plugin table from a descriptor; see the crate documentation.
#[proc_macro]
pub fn export(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as Input);
    match expand(&input) {
        Ok(t) => t.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

/// The Rust type of a descriptor type: a struct of the descriptor is the
/// one generated beside it; any other name is the core's (`<core>::ctypes`),
/// on `span` (where it is declared) so that rustc's "cannot find type" for a
/// type the core lacks points there.
fn rust_ty(t: &Ty, d: &Descriptor, core: &Path, span: Span) -> Tokens {
    match t {
        Ty::Name(n) => {
            let id = Ident::new(n, span);
            if d.struct_named(n).is_some() {
                quote!(#id)
            } else {
                quote_spanned!(span=> #core::ctypes::#id)
            }
        }
        Ty::Ptr { mutable: true, to } => {
            let t = rust_ty(to, d, core, span);
            quote!(*mut #t)
        }
        Ty::Ptr { mutable: false, to } => {
            let t = rust_ty(to, d, core, span);
            quote!(*const #t)
        }
        Ty::Array(t, n) => {
            let t = rust_ty(t, d, core, span);
            quote!([#t; #n])
        }
    }
}

/// Where field `field` of struct `st` is declared in the descriptor.
fn field_span(p: &Parsed, st: &str, field: &str) -> Span {
    p.field_spans
        .iter()
        .find(|(s, f, _)| s == st && f == field)
        .map_or_else(Span::call_site, |(_, _, sp)| *sp)
}

/// The assignments that fill props struct `sname` at `out.<path>`: a field
/// the mapping gives a value takes it; a field whose type is a struct of the
/// descriptor is filled field by field; any other field `f` takes
/// `<core>::props::<path>::f(p)` (`p` is `&<core>::Properties`), on the
/// field's span so that rustc's "cannot find function" points at it.
fn prop_sets(
    sname: &str,
    path: &[Ident],
    input: &Input,
    span: Span,
    sets: &mut Vec<Tokens>,
) -> syn::Result<()> {
    let d = &input.parsed.desc;
    let core = &input.mapping.core;
    let s = d
        .struct_named(sname)
        .ok_or_else(|| syn::Error::new(span, format!("struct {sname} missing")))?;
    for f in &s.fields {
        let fspan = field_span(&input.parsed, sname, &f.name);
        let fid = Ident::new(&f.name, fspan);
        let given = path
            .is_empty()
            .then(|| input.mapping.props.iter().find(|(k, _)| *k == f.name))
            .flatten();
        match (&f.ty, given) {
            (_, Some((_, e))) => sets.push(quote!(out.#fid = #e;)),
            (Ty::Name(n), None) if d.struct_named(n).is_some() => {
                let mut inner = path.to_vec();
                inner.push(fid);
                prop_sets(n, &inner, input, span, sets)?;
            }
            (_, None) => sets.push(
                quote_spanned!(fspan=> out.#(#path.)*#fid = #core::props::#(#path::)*#fid(p);),
            ),
        }
    }
    Ok(())
}

fn expand(input: &Input) -> syn::Result<Tokens> {
    let d = &input.parsed.desc;
    let m = &input.mapping;
    let core = &m.core;
    let family = d.family.as_str();
    let symbol = format_ident!("{}", d.symbol);
    // "ncclNet v9", from the table's name `ncclNet_v9_t`.
    let stem = d.table_name.strip_suffix(&format!("_v{}_t", d.version));
    let label = format!("{} v{}", stem.unwrap_or(&d.table_name), d.version);
    let fam = format_ident!("{}", family);
    let module = format_ident!("{}_v{}", family, d.version);
    let table = format_ident!("{}", d.table_name);

    // Only members NCCL checks for NULL may be left NULL.
    let mut null: Vec<String> = Vec::new();
    for id in &m.null {
        let n = id.to_string();
        match d.table.iter().find(|mm| mm.name() == n) {
            None => {
                return Err(syn::Error::new(
                    id.span(),
                    format!("{label} has no member `{n}`"),
                ))
            }
            Some(Member::Fn {
                optional: false, ..
            }) => {
                return Err(syn::Error::new(
                    id.span(),
                    format!("{label}: member `{n}` cannot be NULL: NCCL calls it unconditionally"),
                ))
            }
            Some(_) => null.push(n),
        }
    }

    // Every result code this version's NCCL knows; the core picks its own.
    let codes = d.results.iter().map(|(n, v)| quote!((#n, #v)));

    let structs = d.structs.iter().map(|s| {
        let id = format_ident!("{}", s.name);
        let fields = s.fields.iter().map(|f| {
            let n = format_ident!("{}", f.name);
            let t = rust_ty(&f.ty, d, core, field_span(&input.parsed, &s.name, &f.name));
            quote!(pub #n: #t)
        });
        quote! {
            #[repr(C)]
            #[derive(Clone, Copy)]
            pub struct #id { #(#fields,)* }
        }
    });

    let mut table_fields = Vec::new();
    let mut inits = Vec::new();
    let mut adapters = Vec::new();
    for (i, mem) in d.table.iter().enumerate() {
        let span = input
            .parsed
            .member_spans
            .get(i)
            .copied()
            .unwrap_or_else(Span::call_site);
        match mem {
            Member::Data(f) => {
                let n = format_ident!("{}", f.name);
                let t = rust_ty(&f.ty, d, core, span);
                let served = Ident::new(&f.name, span);
                table_fields.push(quote!(pub #n: #t));
                inits.push(quote_spanned!(span=> #n: #core::#fam::data::#served));
            }
            Member::Fn {
                name, args, ret, ..
            } => {
                let n = format_ident!("{}", name);
                let arg_names: Vec<Ident> =
                    args.iter().map(|a| format_ident!("{}", a.name)).collect();
                let arg_tys: Vec<Tokens> =
                    args.iter().map(|a| rust_ty(&a.ty, d, core, span)).collect();
                let ret_t = rust_ty(ret, d, core, span);
                table_fields.push(quote!(pub #n: ::core::option::Option<unsafe extern "C" fn(#(#arg_names: #arg_tys),*) -> #ret_t>));
                if null.contains(name) {
                    inits.push(quote!(#n: None));
                    continue;
                }
                let call = if name == "getProperties" {
                    let props_arg = args.iter().find(|a| a.name == "props").ok_or_else(|| {
                        syn::Error::new(
                            span,
                            format!("{label}: getProperties has no `props` argument"),
                        )
                    })?;
                    let Ty::Ptr { to, .. } = &props_arg.ty else {
                        return Err(syn::Error::new(
                            span,
                            format!("{label}: getProperties' props is not a pointer"),
                        ));
                    };
                    let Ty::Name(sname) = &**to else {
                        return Err(syn::Error::new(
                            span,
                            format!("{label}: getProperties' props is not a struct"),
                        ));
                    };
                    let mut sets = Vec::new();
                    prop_sets(sname, &[], input, span, &mut sets)?;
                    let s = d.struct_named(sname).ok_or_else(|| {
                        syn::Error::new(span, format!("{label}: struct {sname} missing"))
                    })?;
                    for (k, _) in &m.props {
                        if !s.fields.iter().any(|f| *k == f.name) {
                            return Err(syn::Error::new(
                                k.span(),
                                format!("{label}: {sname} has no field `{k}`"),
                            ));
                        }
                    }
                    quote! {
                        #core::#fam::get_properties(dev, |p: &#core::Properties| {
                            // SAFETY: `props` is NULL (refused) or NCCL's struct of this
                            // version, which it owns during the call.
                            let out = unsafe { #core::out_ref(props, "props") }?;
                            #(#sets)*
                            Ok(())
                        })
                    }
                } else {
                    // On the member's span, so that rustc's "cannot find
                    // function" points at the member in the descriptor.
                    let served = Ident::new(name, span);
                    let fields = arg_names
                        .iter()
                        .map(|a| quote_spanned!(span=> #a: #core::Conv::conv(#a)));
                    quote! {
                        // SAFETY: every core member function has one contract: the
                        // arguments are as NCCL's C declaration of the member says
                        // (pointers NULL or valid), which NCCL upholds by calling it.
                        unsafe { #core::#fam::#served(#core::#fam::args::#served { #(#fields,)* ..::core::default::Default::default() }) }
                    }
                };
                let what = format!("{label} {name}");
                adapters.push(quote_spanned! {span=>
                    #[allow(clippy::too_many_arguments, clippy::not_unsafe_ptr_arg_deref, clippy::needless_update)]
                    unsafe extern "C" fn #n(#(#arg_names: #arg_tys),*) -> #ret_t {
                        #core::boundary(&RESULTS, #what, move || { #call })
                    }
                });
                inits.push(quote!(#n: Some(#n)));
            }
        }
    }

    Ok(quote! {
        #[allow(non_camel_case_types, non_snake_case, non_upper_case_globals, dead_code, unused_imports)]
        pub mod #module {
            use super::*;
            #(#structs)*

            /// The table NCCL reads.
            #[repr(C)]
            pub struct #table { #(#table_fields,)* }

            // SAFETY: the table is immutable; its pointers are functions and a
            // static string.
            unsafe impl Sync for #table {}

            const RESULTS: #core::Results = #core::Results::from_codes(&[#(#codes),*]);

            #(#adapters)*

            /// The exported table.
            #[unsafe(no_mangle)]
            pub static #symbol: #table = #table { #(#inits,)* };
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A v99 table shaped like the next NCCL: v12's essentials plus a new
    /// member and a new props field.
    fn v99(mapping: &str) -> syn::Result<Tokens> {
        let text = format!(
            "mapping {{ core = mock; {mapping} }}
             family = net; version = 99; symbol = ncclNetPlugin_v99;
             results {{ ncclSuccess = 0, ncclSystemError = 2, ncclInternalError = 3, ncclInvalidUsage = 5, ncclRemoteError = 6 }}
             struct ncclNetProperties_v99_t {{ name: *mut c_char, speed: c_int, newField: c_int }}
             table ncclNet_v99_t {{
                 name: *const c_char,
                 devices: fn(ndev: *mut c_int) -> ncclResult_t,
                 getProperties: fn(dev: c_int, props: *mut ncclNetProperties_v99_t) -> ncclResult_t,
                 newHook: fn(comm: *mut c_void, flags: c_int) -> ncclResult_t,
                 optional newOptional: fn(comm: *mut c_void) -> ncclResult_t,
             }}"
        );
        let input: Input = syn::parse_str(&text)?;
        expand(&input)
    }

    /// The error `v99(mapping)` must give.
    fn err(mapping: &str) -> String {
        v99(mapping).unwrap_err().to_string()
    }

    #[test]
    fn every_member_and_field_is_emitted_for_rustc_to_check() {
        // Neither members nor props fields are checked here: the calls are
        // emitted, and rustc rejects one the core lacks (tests/ui).
        let t = v99("").unwrap().to_string();
        assert!(t.contains("mock :: net :: newHook"), "{t}");
        assert!(
            t.contains("out . newField = mock :: props :: newField (p)"),
            "{t}"
        );
        assert!(t.contains("name : mock :: net :: data :: name"), "{t}");
        assert!(t.contains("pub static ncclNetPlugin_v99"), "{t}");
        // C types are the core's, structs the descriptor's.
        assert!(t.contains("dev : mock :: ctypes :: c_int"), "{t}");
        assert!(t.contains("props : * mut ncclNetProperties_v99_t"), "{t}");
        let t = v99("null = [newOptional]; props { newField = 0 }")
            .unwrap()
            .to_string();
        assert!(t.contains("newOptional : None"), "{t}");
        assert!(t.contains("out . newField = 0"), "{t}");
        assert!(!t.contains("unused_unsafe"), "{t}");
    }

    #[test]
    fn mandatory_members_cannot_be_null() {
        for (mapping, want) in [
            ("null = [devices];", "`devices` cannot be NULL"),
            ("null = [newHook];", "`newHook` cannot be NULL"),
            ("null = [nosuch];", "ncclNet v99 has no member `nosuch`"),
            (
                "props { newField = 0, nosuch = 1 }",
                "has no field `nosuch`",
            ),
        ] {
            let e = err(mapping);
            assert!(e.contains(want), "{mapping}: {e}");
        }
    }
}
