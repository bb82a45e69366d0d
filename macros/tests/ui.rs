//! Compile-time completeness, shown with a mock core: a complete mapping
//! builds and works; an unserved member, an unserved props field and a NULL
//! for a member NCCL always calls are compile errors naming it and the version.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass_minimal.rs");
    t.compile_fail("tests/ui/fail_*.rs");
}
