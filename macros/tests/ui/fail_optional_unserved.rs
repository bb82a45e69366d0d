#[path = "mock.rs"]
mod mock;

// An optional member is served unless the mapping leaves it NULL: the
// mock core has no `frobnicate`, so rustc rejects the call.
weft_macros::export! {
    mapping { core = crate::mock }
    family = net;
    version = 99;
    results { ncclSuccess = 0, ncclSystemError = 2, ncclInternalError = 3, ncclInvalidUsage = 5 }
    table ncclNet_v99_t {
        name: *const c_char,
        devices: fn(ndev: *mut c_int) -> ncclResult_t,
        optional frobnicate: fn(comm: *mut c_void) -> ncclResult_t,
    }
}

fn main() {}
