//! Argument conversions: sizes NCCL passes as `int` or `size_t`, size
//! arrays, scatter-gather lists, virtual-device properties and comm
//! configs, each in the newest API's terms.

use super::*;

/// A size NCCL passes as `int` (older versions) or `size_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CSize {
    /// Absent.
    #[default]
    None,
    /// `int`.
    Int(c_int),
    /// `size_t`.
    Size(usize),
}

impl CSize {
    /// The value, refusing negative `int`s (NCCL misuse).
    pub fn get(self, what: &str) -> Result<usize> {
        match self {
            CSize::None => Ok(0),
            CSize::Size(s) => Ok(s),
            CSize::Int(i) => {
                usize::try_from(i).map_err(|_| Error::internal(format!("negative {what} {i}")))
            }
        }
    }
}

/// A sizes array NCCL passes as `int*` or `size_t*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SizeArray {
    /// Absent or NULL.
    #[default]
    None,
    /// `int*`.
    Int(*mut c_int),
    /// `size_t*`.
    Size(*mut usize),
}

impl SizeArray {
    /// Reads entry `i`.
    ///
    /// # Safety
    /// The array has more than `i` entries.
    pub(super) unsafe fn get(self, i: usize, what: &str) -> Result<usize> {
        // SAFETY: the caller bounds `i` by NCCL's `n`.
        match self {
            // SAFETY: non-NULL, and the caller bounds `i`.
            SizeArray::Int(p) if !p.is_null() => CSize::Int(unsafe { *p.add(i) }).get(what),
            // SAFETY: non-NULL, and the caller bounds `i`.
            SizeArray::Size(p) if !p.is_null() => Ok(unsafe { *p.add(i) }),
            _ => Err(Error::internal(format!("NULL `{what}` array"))),
        }
    }

    /// Writes entry `i`, refusing values an `int` cannot hold.
    ///
    /// # Safety
    /// The array has more than `i` entries.
    pub(super) unsafe fn set(self, i: usize, v: usize, what: &str) -> Result<()> {
        // SAFETY: the caller bounds `i` by NCCL's `n`.
        match self {
            SizeArray::Int(p) if !p.is_null() => {
                let v = c_int::try_from(v).map_err(|_| {
                    Error::internal(format!("{what} {v} does not fit the int NCCL passes"))
                })?;
                // SAFETY: non-NULL, and the caller bounds `i`.
                unsafe { *p.add(i) = v };
                Ok(())
            }
            SizeArray::Size(p) if !p.is_null() => {
                // SAFETY: non-NULL, and the caller bounds `i`.
                unsafe { *p.add(i) = v };
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

/// Conversion of a C argument to the core's argument type. The generated
/// adapters convert every argument with it, so an NCCL version that changes
/// an argument's C type fails to build here, naming both types.
#[diagnostic::on_unimplemented(
    message = "NCCL passes `{Self}` for an argument the core's argument struct cannot take",
    label = "no conversion from this C argument",
    note = "an NCCL version changed this argument's C type: add `impl Conv<T> for {Self}` in plugin/src/adapter/conv.rs, T being the field's type in the core's args struct"
)]
pub trait Conv<T> {
    /// Converts.
    fn conv(self) -> T;
}

impl<T, U> Conv<*mut U> for *mut T {
    fn conv(self) -> *mut U {
        self.cast()
    }
}
impl<T, U> Conv<*const U> for *const T {
    fn conv(self) -> *const U {
        self.cast()
    }
}
macro_rules! same {
    ($($t:ty),*) => { $(impl Conv<$t> for $t { fn conv(self) -> $t { self } })* };
}
same!(c_int, u32, u64, usize, bool, Option<Logger>);
impl Conv<CSize> for c_int {
    fn conv(self) -> CSize {
        CSize::Int(self)
    }
}
impl Conv<CSize> for usize {
    fn conv(self) -> CSize {
        CSize::Size(self)
    }
}
impl Conv<SizeArray> for *mut c_int {
    fn conv(self) -> SizeArray {
        SizeArray::Int(self)
    }
}
impl Conv<SizeArray> for *mut usize {
    fn conv(self) -> SizeArray {
        SizeArray::Size(self)
    }
}

pub(super) const NULL: *mut c_void = std::ptr::null_mut();
pub(super) const NULL2: *mut *mut c_void = std::ptr::null_mut();

/// `ncclNetSGE_vN_t*` of any version (v8+): its `size` is 32 bits in v8
/// and `size_t` from v9 on; the rest is the same.
#[derive(Debug, Clone, Copy, Default)]
pub enum SgePtr {
    /// Not given.
    #[default]
    None,
    /// v8: 32-bit size.
    Narrow(*const c_void),
    /// v9+: `size_t` size.
    Wide(*const c_void),
}

#[repr(C)]
pub(super) struct Sge<S> {
    pub(super) mhandle: *mut c_void,
    pub(super) address: *mut c_void,
    pub(super) size: S,
}

impl SgePtr {
    /// (mhandle, address, size) of the one element of a list of `n` (NCCL
    /// always passes one).
    ///
    /// # Safety
    /// The pointer is NULL or NCCL's SGE array of the version it came from.
    pub(super) unsafe fn only(
        self,
        n: c_int,
        what: &str,
    ) -> Result<(*mut c_void, *mut c_void, usize)> {
        if n != 1 {
            return Err(Error::internal(format!(
                "{what}: {n} scatter-gather parts (NCCL passes 1)"
            )));
        }
        let null = || Error::internal(format!("{what}: NULL scatter-gather list"));
        // SAFETY: NCCL's array of this version's layout (caller's contract).
        unsafe {
            match self {
                SgePtr::None => Err(null()),
                SgePtr::Narrow(p) => p
                    .cast::<Sge<u32>>()
                    .as_ref()
                    .map(|s| (s.mhandle, s.address, s.size as usize))
                    .ok_or_else(null),
                SgePtr::Wide(p) => p
                    .cast::<Sge<usize>>()
                    .as_ref()
                    .map(|s| (s.mhandle, s.address, s.size))
                    .ok_or_else(null),
            }
        }
    }
}

macro_rules! sge {
    ($($m:ident :: $t:ident => $v:ident),*) => {$(
        impl Conv<SgePtr> for *mut crate::$m::$t {
            fn conv(self) -> SgePtr {
                SgePtr::$v(self.cast_const().cast())
            }
        }
    )*};
}
sge!(collnet_v8::ncclNetSGE_v8_t => Narrow, collnet_v9::ncclNetSGE_v9_t => Wide,
     collnet_v10::ncclNetSGE_v10_t => Wide, collnet_v11::ncclNetSGE_v11_t => Wide,
     collnet_v12::ncclNetSGE_v12_t => Wide);

/// `ncclNetVDeviceProps_vN_t*` of any version (v9+): `{int ndevs; int
/// devs[cap]}`, where `cap` is 4 up to v11 and 8 from v12.
#[derive(Debug, Clone, Copy)]
pub struct VProps {
    pub(super) ptr: *const c_int,
    pub(super) cap: usize,
}

impl Default for VProps {
    fn default() -> Self {
        Self {
            ptr: std::ptr::null(),
            cap: 0,
        }
    }
}

impl VProps {
    /// The devices listed.
    ///
    /// # Safety
    /// The pointer is NULL or NCCL's struct of the version it came from.
    pub(super) unsafe fn devs(self) -> Result<Vec<i32>> {
        if self.ptr.is_null() {
            return Err(Error::internal("makeVDevice: NULL props"));
        }
        // SAFETY: NCCL's struct: ndevs, then `cap` ints.
        let n = unsafe { *self.ptr };
        let n = usize::try_from(n)
            .ok()
            .filter(|n| (1..=self.cap).contains(n))
            .ok_or_else(|| {
                Error::internal(format!(
                    "makeVDevice: ndevs = {n} (1 ..= {} in this API version)",
                    self.cap
                ))
            })?;
        // SAFETY: n <= cap entries follow ndevs.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.add(1), n) }.to_vec())
    }
}

/// Any version's `ncclNetVDeviceProps_vN_t*`: the capacity of `devs`
/// follows from the struct's size (`{int ndevs; int devs[cap]}` in every
/// version so far), so a new version's struct converts without code here.
impl<T> Conv<VProps> for *mut T {
    fn conv(self) -> VProps {
        VProps {
            ptr: self.cast_const().cast(),
            cap: std::mem::size_of::<T>().saturating_sub(4) / 4,
        }
    }
}

/// `ncclNetCommConfig_vN_t` (v10+), the same in every version.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CommConfig {
    /// -1: undefined.
    pub traffic_class: c_int,
}
