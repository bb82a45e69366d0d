#[path = "mock.rs"]
mod mock;

weft_macros::export! {
    mapping { core = crate::mock; null = [devices] }
    family = net;
    version = 99;
    symbol = ncclNetPlugin_v99;
    results { ncclSuccess = 0, ncclSystemError = 2, ncclInternalError = 3, ncclInvalidUsage = 5 }
    table ncclNet_v99_t {
        name: *const c_char,
        devices: fn(ndev: *mut c_int) -> ncclResult_t,
    }
}

fn main() {}
