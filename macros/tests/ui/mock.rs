// A small mock of the core the generated adapters call (the real one is
// weft::adapter): just enough for the trybuild cases.
#![allow(dead_code, non_snake_case, non_camel_case_types, unused_imports)]
use std::ffi::{c_int, c_void, CStr};

pub const NAME: &CStr = c"Mock";
pub type Logger = unsafe extern "C" fn(c_int, std::ffi::c_ulong, *const std::ffi::c_char, c_int, *const std::ffi::c_char, ...);
pub struct Results { pub system: c_int, pub internal: c_int, pub invalid_usage: c_int, pub remote: c_int }
impl Results {
    pub const fn from_codes(_: &[(&str, i64)]) -> Results { Results { system: 2, internal: 3, invalid_usage: 5, remote: 2 } }
}
pub mod ctypes {
    pub use std::ffi::{c_char, c_int, c_void};
    pub use std::primitive::u16;
    pub type ncclResult_t = c_int;
    pub type ncclDebugLogger_t = Option<super::Logger>;
}
pub mod props {
    use super::Properties;
    pub fn name(p: &Properties) -> *mut std::ffi::c_char { p.name.as_ptr().cast_mut() }
    pub fn speed(p: &Properties) -> std::ffi::c_int { p.speed }
}
pub struct Properties { pub name: std::ffi::CString, pub speed: c_int }

pub fn boundary(r: &Results, _what: &str, f: impl FnOnce() -> Result<(), String>) -> c_int {
    match f() { Ok(()) => 0, Err(_) => r.internal }
}
pub unsafe fn out_ref<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T, String> {
    unsafe { p.as_mut() }.ok_or_else(|| format!("NULL {what}"))
}
#[diagnostic::on_unimplemented(message = "NCCL passes `{Self}` for an argument the core's argument struct cannot take")]
pub trait Conv<T> { fn conv(self) -> T; }
impl<T, U> Conv<*mut U> for *mut T { fn conv(self) -> *mut U { self.cast() } }
impl Conv<c_int> for c_int { fn conv(self) -> c_int { self } }
impl Conv<Option<Logger>> for Option<Logger> { fn conv(self) -> Option<Logger> { self } }

pub mod net {
    use super::*;
    pub mod data { pub const name: *const std::ffi::c_char = super::super::NAME.as_ptr(); }
    pub mod args {
        use super::*;
        #[derive(Default)] pub struct init { pub logFunction: Option<Logger> }
        pub struct devices { pub ndev: *mut c_int }
        impl Default for devices { fn default() -> Self { Self { ndev: std::ptr::null_mut() } } }
    }
    pub unsafe fn init(_: args::init) -> Result<(), String> { Ok(()) }
    pub unsafe fn devices(a: args::devices) -> Result<(), String> { *out_ref(a.ndev, "ndev")? = 1; Ok(()) }
    pub fn get_properties(_dev: c_int, f: impl FnOnce(&Properties) -> Result<(), String>) -> Result<(), String> {
        f(&Properties { name: c"mock0".into(), speed: 100 })
    }
}
