#[path = "mock.rs"]
mod mock;

// A version that introduces a C type the core does not define: rustc names
// it, in the core's `ctypes` module, at the member that uses it.
weft_macros::export! {
    mapping { core = crate::mock }
    family = net;
    version = 99;
    symbol = ncclNetPlugin_v99;
    results { ncclSuccess = 0, ncclSystemError = 2, ncclInternalError = 3, ncclInvalidUsage = 5 }
    table ncclNet_v99_t {
        name: *const c_char,
        devices: fn(ndev: *mut ncclNetNewKind_t) -> ncclResult_t,
    }
}

fn main() {}
