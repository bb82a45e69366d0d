#[path = "mock.rs"]
mod mock;

weft_macros::export! {
    mapping { core = crate::mock; props { newField = 7 } }
    family = net;
    version = 99;
    symbol = ncclNetPlugin_v99;
    results { ncclSuccess = 0, ncclSystemError = 2, ncclInternalError = 3, ncclInvalidUsage = 5 }
    struct ncclNetProperties_v99_t { name: *mut c_char, speed: c_int, newField: c_int }
    table ncclNet_v99_t {
        name: *const c_char,
        init: fn(logFunction: ncclDebugLogger_t) -> ncclResult_t,
        devices: fn(ndev: *mut c_int) -> ncclResult_t,
        getProperties: fn(dev: c_int, props: *mut ncclNetProperties_v99_t) -> ncclResult_t,
    }
}

fn main() {
    let t = &net_v99::ncclNetPlugin_v99;
    let mut n = 0;
    let mut p = net_v99::ncclNetProperties_v99_t { name: std::ptr::null_mut(), speed: 0, newField: 0 };
    unsafe {
        assert_eq!(std::ffi::CStr::from_ptr(t.name).to_str().unwrap(), "Mock");
        assert_eq!((t.devices.unwrap())(&mut n), 0);
        assert_eq!((t.getProperties.unwrap())(0, &mut p), 0);
        assert_eq!((t.devices.unwrap())(std::ptr::null_mut()), 3, "NULL is an internal error");
    }
    assert_eq!((n, p.speed, p.newField), (1, 100, 7));
}
