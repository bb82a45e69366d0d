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
//! `#[no_mangle] static ncclNetPlugin_vN` / `ncclCollNetPlugin_vN`. An adapter
//! only converts and forwards: every C argument goes, by its C name, into the
//! core's argument struct for that member (`<core>::<family>::args::<member>`;
//! arguments a version lacks take the core's defaults), the core function
//! runs under `<core>::boundary` (panics caught, errors logged and mapped to
//! the codes this version's NCCL knows). `getProperties` fills every field of
//! the version's props struct from the core's properties.
//!
//! The macro knows no member by name but `getProperties` (whose struct it
//! fills field by field): it emits a call for every member the mapping does
//! not leave `null`, and rustc rejects a member the core does not serve
//! ("cannot find function `x` in module `<core>::<family>`", pointing at the
//! member in the descriptor). Only members the descriptor marks `optional`
//! (NCCL checks them for NULL) may be mapped `null`; which ones Weft leaves
//! NULL is said where the tables are exported (plugin/src/lib.rs).

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

fn rust_ty(t: &Ty, core: &Path) -> Tokens {
    match t {
        Ty::Name(n) => {
            let id = format_ident!("{}", n);
            match n.as_str() {
                "c_int" | "c_uint" | "c_char" | "c_void" | "c_ulong" | "c_long" => {
                    quote!(::std::os::raw::#id)
                }
                "ncclDebugLogger_t" => quote!(::core::option::Option<#core::Logger>),
                "ncclProfilerCallback_t" => quote!(*mut ::std::os::raw::c_void),
                "ncclResult_t" | "ncclDataType_t" | "ncclRedOp_t" | "ncclNetDeviceType" => {
                    quote!(::std::os::raw::c_int)
                }
                _ => quote!(#id),
            }
        }
        Ty::Ptr { mutable: true, to } => {
            let t = rust_ty(to, core);
            quote!(*mut #t)
        }
        Ty::Ptr { mutable: false, to } => {
            let t = rust_ty(to, core);
            quote!(*const #t)
        }
        Ty::Array(t, n) => {
            let t = rust_ty(t, core);
            quote!([#t; #n])
        }
    }
}

/// How the core's properties fill one props field (`p` is `&<core>::Properties`).
fn prop_field(name: &str, ty: &Ty, d: &Descriptor, core: &Path) -> Option<Tokens> {
    Some(match name {
        "name" => quote!(p.name.as_ptr().cast_mut()),
        "pciPath" => quote!(p
            .pci_path
            .as_ref()
            .map_or(::std::ptr::null_mut(), |c| c.as_ptr().cast_mut())),
        "guid" => quote!(p.guid),
        "ptrSupport" => quote!(p.ptr_support),
        "regIsGlobal" => quote!(p.reg_is_global),
        "forceFlush" => quote!(p.force_flush),
        "speed" => quote!(p.speed),
        "port" => quote!(p.port),
        "latency" => quote!(p.latency),
        "maxComms" => quote!(p.max_comms),
        "maxRecvs" => quote!(p.max_recvs),
        "netDeviceType" => quote!(p.net_device_type),
        "netDeviceVersion" => quote!(p.net_device_version),
        "maxP2pBytes" => quote!(p.max_p2p_bytes),
        "maxCollBytes" => quote!(p.max_coll_bytes),
        "maxMultiRequestSize" => quote!(p.max_multi_request_size),
        "railId" => quote!(p.rail_id),
        "planeId" => quote!(p.plane_id),
        "vProps" => {
            let Ty::Name(sname) = ty else { return None };
            let s = d.struct_named(sname)?;
            let cap = s.fields.iter().find_map(|f| match (&f.name[..], &f.ty) {
                ("devs", Ty::Array(_, n)) => Some(*n),
                _ => None,
            })?;
            let sid = format_ident!("{}", sname);
            let _ = core;
            quote!({
                let mut v = #sid { ndevs: 0, devs: [0; #cap] };
                for (slot, d) in v.devs.iter_mut().zip(p.vdevs.iter()) {
                    *slot = *d;
                    v.ndevs += 1;
                }
                v
            })
        }
        _ => return None,
    })
}

fn expand(input: &Input) -> syn::Result<Tokens> {
    let d = &input.parsed.desc;
    let m = &input.mapping;
    let core = &m.core;
    let family = d.family.as_str();
    let (symbol, label) = match family {
        "net" => (
            format_ident!("ncclNetPlugin_v{}", d.version),
            format!("ncclNet v{}", d.version),
        ),
        "collnet" => (
            format_ident!("ncclCollNetPlugin_v{}", d.version),
            format!("ncclCollNet v{}", d.version),
        ),
        other => {
            return Err(syn::Error::new(
                Span::call_site(),
                format!("unknown family `{other}`"),
            ))
        }
    };
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

    // Result codes this version's NCCL knows.
    let code = |n: &str| {
        d.results
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| *v as i32)
    };
    let need = |n: &str| {
        code(n).ok_or_else(|| {
            syn::Error::new(
                Span::call_site(),
                format!("{label}: descriptor lacks result code {n}"),
            )
        })
    };
    let (system, internal, usage) = (
        need("ncclSystemError")?,
        need("ncclInternalError")?,
        need("ncclInvalidUsage")?,
    );
    let remote = code("ncclRemoteError").unwrap_or(system);

    let structs = d.structs.iter().map(|s| {
        let id = format_ident!("{}", s.name);
        let fields = s.fields.iter().map(|f| {
            let n = format_ident!("{}", f.name);
            let t = rust_ty(&f.ty, core);
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
                let t = rust_ty(&f.ty, core);
                if f.name != "name" {
                    return Err(syn::Error::new(
                        span,
                        format!(
                            "{label}: data member `{}` is not served by the core",
                            f.name
                        ),
                    ));
                }
                table_fields.push(quote!(pub #n: #t));
                inits.push(quote!(#n: #core::NAME.as_ptr()));
            }
            Member::Fn {
                name, args, ret, ..
            } => {
                let n = format_ident!("{}", name);
                let arg_names: Vec<Ident> =
                    args.iter().map(|a| format_ident!("{}", a.name)).collect();
                let arg_tys: Vec<Tokens> = args.iter().map(|a| rust_ty(&a.ty, core)).collect();
                let ret_t = rust_ty(ret, core);
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
                    let s = d.struct_named(sname).ok_or_else(|| {
                        syn::Error::new(span, format!("{label}: struct {sname} missing"))
                    })?;
                    let mut sets = Vec::new();
                    for f in &s.fields {
                        let fid = format_ident!("{}", f.name);
                        let value = match m.props.iter().find(|(k, _)| *k == f.name) {
                            Some((_, e)) => quote!(#e),
                            None => prop_field(&f.name, &f.ty, d, core).ok_or_else(|| {
                                let fspan = input
                                    .parsed
                                    .field_spans
                                    .iter()
                                    .find(|(st, fl, _)| st == sname && *fl == f.name)
                                    .map_or(span, |(_, _, sp)| *sp);
                                syn::Error::new(fspan, format!(
                                    "{label}: props field `{}.{}` is not served by the core; give it a value in the mapping (`props {{ {} = ... }}`) or serve it in the core",
                                    sname, f.name, f.name
                                ))
                            })?,
                        };
                        sets.push(quote!(out.#fid = #value;));
                    }
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

            const RESULTS: #core::Results = #core::Results {
                system: #system,
                internal: #internal,
                invalid_usage: #usage,
                remote: #remote,
            };

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
             family = net; version = 99;
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
    fn unserved_field_is_named_with_the_version() {
        let e = err("");
        assert!(
            e.contains("ncclNet v99: props field `ncclNetProperties_v99_t.newField` is not served"),
            "{e}"
        );
        // A member is not checked here: the call is emitted, and rustc
        // rejects it if the core lacks the function (tests/ui).
        let t = v99("props { newField = 0 }").unwrap().to_string();
        assert!(t.contains("mock :: net :: newHook"), "{t}");
        let t = v99("null = [newOptional]; props { newField = 0 }")
            .unwrap()
            .to_string();
        assert!(t.contains("newOptional : None"), "{t}");
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
