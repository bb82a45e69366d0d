#[path = "mock.rs"]
mod mock;

// A version that changes an argument's C type: the conversion into the
// core's argument is missing, and the error names both types.
weft_macros::export! {
    mapping { core = crate::mock }
    family = net;
    version = 99;
    symbol = ncclNetPlugin_v99;
    results { ncclSuccess = 0, ncclSystemError = 2, ncclInternalError = 3, ncclInvalidUsage = 5 }
    table ncclNet_v99_t {
        name: *const c_char,
        devices: fn(ndev: u16) -> ncclResult_t,
    }
}

fn main() {}
