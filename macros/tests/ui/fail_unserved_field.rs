#[path = "mock.rs"]
mod mock;

weft_macros::export! {
    mapping { core = crate::mock }
    family = net;
    version = 99;
    symbol = ncclNetPlugin_v99;
    results { ncclSuccess = 0, ncclSystemError = 2, ncclInternalError = 3, ncclInvalidUsage = 5 }
    struct ncclNetProperties_v99_t { name: *mut c_char, frobLevel: c_int }
    table ncclNet_v99_t {
        name: *const c_char,
        getProperties: fn(dev: c_int, props: *mut ncclNetProperties_v99_t) -> ncclResult_t,
    }
}

fn main() {}
