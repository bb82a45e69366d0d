#[path = "mock.rs"]
mod mock;

// Members the mock core does not serve: a mandatory one, and an optional one
// the mapping does not leave NULL (optional members are served unless mapped
// `null`); rustc rejects both calls, on the member.
weft_macros::export! {
    mapping { core = crate::mock }
    family = net;
    version = 99;
    symbol = ncclNetPlugin_v99;
    results { ncclSuccess = 0, ncclSystemError = 2, ncclInternalError = 3, ncclInvalidUsage = 5 }
    table ncclNet_v99_t {
        name: *const c_char,
        devices: fn(ndev: *mut c_int) -> ncclResult_t,
        frobnicate: fn(comm: *mut c_void) -> ncclResult_t,
        optional frobnicateMore: fn(comm: *mut c_void) -> ncclResult_t,
    }
}

fn main() {}
