//! Compile-time completeness, shown with a mock core: a complete mapping
//! builds and works; a member the core does not serve (mandatory, or optional
//! and not mapped `null`) or a props field it does not serve is rustc's
//! "cannot find function" on the member or field; a C type the core does not
//! define is rustc's "cannot find type" on the member; a NULL for a member
//! NCCL always calls is the macro's error naming it and the version; an
//! argument whose C type changed is the conversion trait's message.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass_minimal.rs");
    t.compile_fail("tests/ui/fail_*.rs");
}
