//! What Weft takes from NCCL's plugin ABI that every layer may need, and
//! nothing else: the size of NCCL's handle buffer, and the text form handles
//! travel in (handle files, `weft-reducer`'s output, `WEFT_COLLNET_REDUCERS`,
//! the tests' peer processes). A leaf: it uses no other module of the crate.

#![forbid(unsafe_code)]

/// Size of NCCL's handle buffer (`NCCL_NET_HANDLE_MAXSIZE`).
pub const HANDLE_SIZE: usize = 128;

/// Bytes as lower-case hex.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Hex back to bytes (surrounding blanks ignored); `None` if it is not
/// whole hex bytes.
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    let s = s.trim();
    if s.len() % 2 != 0 || !s.is_ascii() {
        return None;
    }
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok())
        .collect()
}

/// A handle from its hex.
pub fn handle_from_hex(s: &str) -> Option<[u8; HANDLE_SIZE]> {
    unhex(s)?.try_into().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_refuses_what_is_not_hex() {
        let h = [0xa5u8; HANDLE_SIZE];
        assert_eq!(handle_from_hex(&hex(&h)), Some(h));
        assert_eq!(unhex(" 0aff \n"), Some(vec![0x0a, 0xff]));
        assert_eq!(unhex("abc"), None);
        assert_eq!(unhex("zz"), None);
        assert_eq!(handle_from_hex(&"ab".repeat(HANDLE_SIZE - 1)), None);
    }
}
