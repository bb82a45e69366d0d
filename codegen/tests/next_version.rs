//! "The next NCCL in one step": a synthetic `net_v99.h` (written at test time
//! from Weft's own v12 descriptor plus one new member and one new props
//! field, never from NCCL's text) goes through codegen and the proc macro
//! against the real core; the only hand-written code is what serves the
//! additions: the new member's argument struct and function (called through
//! the table) and the new field's accessor beside the core's.

use std::path::PathBuf;

use weft_api::model::{Field, Member, Ty};
use weft_codegen::{as_version, body_of_file, from_dir, render_file, write_synthetic_headers};

#[test]
fn v99_needs_only_the_mapping_of_its_additions() {
    let committed = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../api-versions/src/generated/net_v12.rs"
    ))
    .unwrap();
    let v12 = weft_api::model::parse_str(&body_of_file(&committed).unwrap()).unwrap();
    let mut v99 = as_version(&v12, 99);
    v99.structs
        .iter_mut()
        .find(|s| s.name == "ncclNetProperties_v99_t")
        .unwrap()
        .fields
        .push(Field {
            name: "newField".into(),
            ty: Ty::Name("c_int".into()),
        });
    v99.table.push(Member::Fn {
        name: "newHook".into(),
        optional: false,
        args: vec![
            Field {
                name: "comm".into(),
                ty: Ty::Ptr {
                    mutable: true,
                    to: Box::new(Ty::Name("c_void".into())),
                },
            },
            Field {
                name: "flags".into(),
                ty: Ty::Name("c_int".into()),
            },
        ],
        ret: Ty::Name("ncclResult_t".into()),
    });

    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("next-version");
    let headers = out.join("include");
    write_synthetic_headers(&v99, &headers).unwrap();
    let (descs, _) = from_dir(&headers).expect("codegen reads the synthetic header");
    let read = descs
        .iter()
        .find(|d| d.version == 99)
        .expect("codegen found ncclNet_v99_t");
    assert_eq!(
        read, &v99,
        "codegen must read back exactly the synthetic v99"
    );

    // The crate a maintainer would write: the generated descriptor, the core
    // serving the new member (an argument struct and a function) and the new
    // props field (an accessor), here next to the real core's, and one line
    // exporting the table, whose mapping names only the NULL members.
    let src = format!(
        "{descriptor}\n\
         // The hand-written code for v99: the new member, served.\n\
         mod core {{\n\
             pub use weft::adapter::*;\n\
             pub mod props {{\n\
                 pub use weft::adapter::props::*;\n\
                 #[allow(non_snake_case)]\n\
                 pub fn newField(p: &weft::adapter::Properties) -> std::ffi::c_int {{ p.port + 41 }}\n\
             }}\n\
             pub mod net {{\n\
                 pub use weft::adapter::net::*;\n\
                 pub static FLAGS: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);\n\
                 #[allow(non_camel_case_types, non_snake_case)]\n\
                 pub mod args {{\n\
                     pub use weft::adapter::net::args::*;\n\
                     pub struct newHook {{ pub comm: *mut std::ffi::c_void, pub flags: std::ffi::c_int }}\n\
                     impl Default for newHook {{ fn default() -> Self {{ Self {{ comm: std::ptr::null_mut(), flags: 0 }} }} }}\n\
                 }}\n\
                 #[allow(non_snake_case)]\n\
                 pub unsafe fn newHook(a: args::newHook) -> weft::error::Result<()> {{\n\
                     FLAGS.store(a.flags, std::sync::atomic::Ordering::Relaxed);\n\
                     Ok(())\n\
                 }}\n\
             }}\n\
         }}\n\
         net_v99!(weft_macros::export {{ core = crate::core; null = [getDeviceMr, irecvConsumed] }});\n\n\
         fn main() {{\n\
             let t = &net_v99::ncclNetPlugin_v99;\n\
             assert_eq!(std::mem::size_of::<net_v99::ncclNet_v99_t>(), 23 * std::mem::size_of::<usize>());\n\
             assert!(t.isend.is_some() && t.getProperties.is_some() && t.getDeviceMr.is_none());\n\
             assert_eq!(unsafe {{ (t.newHook.unwrap())(std::ptr::null_mut(), 42) }}, 0);\n\
             assert_eq!(core::net::FLAGS.load(std::sync::atomic::Ordering::Relaxed), 42, \"the served newHook ran\");\n\
             assert_eq!(unsafe {{ std::ffi::CStr::from_ptr(t.name) }}.to_str().unwrap(), \"Weft\");\n\
         }}\n",
        descriptor = render_file(read, "synthetic net_v99.h")
    );
    let file = out.join("v99.rs");
    std::fs::write(&file, src).unwrap();
    trybuild::TestCases::new().pass(&file);
}

/// The next RMA version in one step: v16 as a synthetic `ncclRma_v17_t`
/// goes through codegen and the proc macro against the real RMA adapter,
/// with no hand-written code at all (every member is one v16 serves).
#[test]
fn rma_v17_is_a_descriptor_away() {
    let committed = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../api-versions/src/generated/rma_v16.rs"
    ))
    .unwrap();
    let v16 = weft_api::model::parse_str(&body_of_file(&committed).unwrap()).unwrap();
    let v17 = as_version(&v16, 17);
    assert_eq!(v17.symbol, "ncclRmaPlugin_v17");
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("next-rma-version");
    let headers = out.join("include");
    write_synthetic_headers(&v17, &headers).unwrap();
    let (descs, _) = from_dir(&headers).expect("codegen reads the synthetic header");
    let read = descs
        .iter()
        .find(|d| d.family == "rma" && d.version == 17)
        .expect("codegen found ncclRma_v17_t");
    assert_eq!(
        read, &v17,
        "codegen must read back exactly the synthetic v17"
    );
    let src = format!(
        "{descriptor}\n\
         rma_v17!(weft_macros::export {{ core = weft::adapter }});\n\n\
         fn main() {{\n\
             let t = &rma_v17::ncclRmaPlugin_v17;\n\
             assert_eq!(std::mem::size_of::<rma_v17::ncclRma_v17_t>(), 22 * std::mem::size_of::<usize>());\n\
             assert_eq!(std::mem::offset_of!(rma_v17::ncclRma_v17_t, getRmaProperties), 3 * std::mem::size_of::<usize>());\n\
             assert!(t.iputSignal.is_some() && t.getRmaProperties.is_some() && t.rmaProgress.is_some());\n\
             assert_eq!(unsafe {{ std::ffi::CStr::from_ptr(t.name) }}.to_str().unwrap(), \"Weft\");\n\
             let mut n = -1;\n\
             assert_ne!(unsafe {{ (t.devices.unwrap())(&mut n) }}, 0, \"devices before init is refused\");\n\
         }}\n",
        descriptor = render_file(read, "synthetic rma_v17.h")
    );
    let file = out.join("v17.rs");
    std::fs::write(&file, src).unwrap();
    trybuild::TestCases::new().pass(&file);
}
