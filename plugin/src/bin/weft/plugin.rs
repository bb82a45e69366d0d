//! Loading the plugin as NCCL does: `dlopen` of the library, then its
//! tables by symbol name.
//!
//! Without `--plugin`, the library is looked for beside this program, then
//! by name through the dynamic loader (`LD_LIBRARY_PATH`, the loader cache),
//! as NCCL finds `libnccl-net-weft.so`.

use std::ffi::{c_void, CStr, CString};
use std::path::PathBuf;

/// The library name NCCL looks for with `NCCL_NET_PLUGIN=weft`.
const LIB_NAME: &str = "libnccl-net-weft.so";

/// A `dlopen`ed library (never closed: the plugin is linked nodelete).
pub struct Lib {
    handle: *mut c_void,
    /// Where it was loaded from.
    pub path: String,
}

impl Lib {
    pub fn open(path: &str) -> Result<Self, String> {
        let c = CString::new(path).map_err(|e| e.to_string())?;
        // SAFETY: a NUL-terminated path; dlopen runs the library's
        // initialisers, which Weft keeps trivial.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            // SAFETY: dlerror returns NULL or a NUL-terminated message.
            let e = unsafe { libc::dlerror() };
            let why = if e.is_null() {
                "unknown error".to_owned()
            } else {
                // SAFETY: as above.
                unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
            };
            return Err(format!("dlopen({path}): {why}"));
        }
        Ok(Self {
            handle,
            path: path.to_owned(),
        })
    }

    /// The address of symbol `name`, if exported.
    pub fn sym(&self, name: &str) -> Option<*mut c_void> {
        let c = CString::new(name).ok()?;
        // SAFETY: a live handle and a NUL-terminated name.
        let p = unsafe { libc::dlsym(self.handle, c.as_ptr()) };
        (!p.is_null()).then_some(p)
    }
}

/// Finds the plugin as the usage text says.
pub fn open_plugin(explicit: Option<String>) -> Result<Lib, String> {
    if let Some(p) = explicit {
        return Lib::open(&p);
    }
    let beside: Option<PathBuf> = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join(LIB_NAME)))
        .filter(|p| p.exists());
    match beside {
        Some(p) => Lib::open(&p.to_string_lossy()),
        None => Lib::open(LIB_NAME),
    }
}

impl Lib {
    /// The table exported as `name`, typed as `T` by the caller.
    ///
    /// # Safety
    /// `T` must be the type of the table the library exports under `name`.
    pub unsafe fn table<T>(&self, name: &str) -> Result<&'static T, String> {
        let p = self
            .sym(name)
            .ok_or_else(|| format!("{} exports no {name}", self.path))?;
        // SAFETY: the caller's promise; the library is never closed, so its
        // static table lives as long as the program.
        Ok(unsafe { &*p.cast::<T>() })
    }
}
