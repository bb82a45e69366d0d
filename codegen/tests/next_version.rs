//! "The next NCCL in one step": a synthetic `net_v99.h` (written at test time
//! from Weft's own v12 descriptor plus one new optional member and one new
//! props field, never from NCCL's text) goes through codegen and the proc
//! macro against the real core; the only hand-written code is the mapping
//! of the two additions.

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

    // The crate a maintainer would write: the generated descriptor plus one
    // line that maps the two additions.
    let src = format!(
        "{descriptor}\n\
         // The only hand-written code for v99:\n\
         net_v99!(weft_macros::export {{ core = weft::adapter; null = [newHook]; props {{ newField = 0 }} }});\n\n\
         fn main() {{\n\
             let t = &net_v99::ncclNetPlugin_v99;\n\
             assert_eq!(std::mem::size_of::<net_v99::ncclNet_v99_t>(), 23 * std::mem::size_of::<usize>());\n\
             assert!(t.newHook.is_none() && t.isend.is_some() && t.getProperties.is_some());\n\
             assert_eq!(unsafe {{ std::ffi::CStr::from_ptr(t.name) }}.to_str().unwrap(), \"Weft\");\n\
         }}\n",
        descriptor = render_file(read, "synthetic net_v99.h")
    );
    let file = out.join("v99.rs");
    std::fs::write(&file, src).unwrap();
    trybuild::TestCases::new().pass(&file);
}
