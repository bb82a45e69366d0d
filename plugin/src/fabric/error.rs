//! Typed libfabric errors: the call that failed, the code and `fi_strerror` text.

use std::ffi::CStr;

use libfabric_sys as fi;

/// A negative return from a libfabric call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{call} failed: {text} (fi errno {code})")]
pub struct FiError {
    /// The libfabric call that failed, e.g. `fi_getinfo`.
    pub call: &'static str,
    /// The positive libfabric error number (`FI_EAGAIN`, `FI_ETRUNC`, ...).
    pub code: u32,
    /// `fi_strerror(code)`.
    pub text: String,
}

impl FiError {
    /// Builds the error for `call` from a libfabric error number (either sign).
    pub fn new(call: &'static str, code: i64) -> Self {
        let code = u32::try_from(code.unsigned_abs()).unwrap_or(u32::MAX);
        Self {
            call,
            code,
            text: strerror(code),
        }
    }

    /// `FI_EAGAIN`: the call may succeed if retried after progress.
    pub fn is_again(&self) -> bool {
        self.code == fi::FI_EAGAIN
    }
}

/// Whether an operation that completed with error `err` says its
/// connection to the peer is gone, so that nothing more can go over it: a
/// reset, refused, aborted or shut down connection, an unreachable peer or
/// network, a timeout, or `FI_ECANCELED` on an operation Weft did not cancel
/// (verbs flushes every work request of a queue pair whose transport
/// retries ran out, and rxm reports each as cancelled).
pub fn breaks_connection(err: u32) -> bool {
    [
        fi::FI_ECANCELED,
        fi::FI_ECONNRESET,
        fi::FI_ECONNABORTED,
        fi::FI_ECONNREFUSED,
        fi::FI_ENOTCONN,
        fi::FI_ESHUTDOWN,
        fi::FI_ETIMEDOUT,
        fi::FI_EHOSTUNREACH,
        fi::FI_ENETUNREACH,
        fi::FI_ENETDOWN,
    ]
    .contains(&err)
}

/// `fi_strerror` as an owned string.
pub fn strerror(code: u32) -> String {
    let code = i32::try_from(code).unwrap_or(i32::MAX);
    // SAFETY: fi_strerror accepts any number and returns a pointer to a static,
    // NUL-terminated string (an "Unknown error" text for numbers it does not know).
    unsafe { CStr::from_ptr(fi::fi_strerror(code)) }
        .to_string_lossy()
        .into_owned()
}

/// Turns a libfabric return value into `Ok(value)` or a typed error.
pub fn check(call: &'static str, ret: impl TryInto<i64>) -> Result<u64, FiError> {
    // libfabric returns int or ssize_t; both fit i64 on every platform it supports.
    let ret: i64 = ret.try_into().unwrap_or(i64::MIN);
    if ret < 0 {
        Err(FiError::new(call, ret))
    } else {
        Ok(ret.unsigned_abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negative_returns_become_errors_with_text() {
        let e = check("fi_tsend", -(fi::FI_EAGAIN as i64)).unwrap_err();
        assert!(e.is_again());
        assert_eq!(e.call, "fi_tsend");
        assert!(e.to_string().starts_with("fi_tsend failed: "), "{e}");
        assert!(!e.text.is_empty());
        assert_eq!(check("fi_close", 0).unwrap(), 0);
        assert_eq!(check("fi_cq_read", 3isize as i64).unwrap(), 3);
    }

    #[test]
    fn truncation_is_named() {
        let e = FiError::new("fi_cq_readerr", fi::FI_ETRUNC as i64);
        assert!(!e.is_again());
        assert_eq!(e.code, fi::FI_ETRUNC);
        assert!(e.text.to_lowercase().contains("trunc"), "{}", e.text);
    }
}
