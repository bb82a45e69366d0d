//! Bytes on the wire and in NCCL's handle buffer: the listen handle and the
//! control messages of the connection handshake and credit flow. Pure
//! encoding and validation, testable without a network.
//!
//! Listen handle (NCCL's 128-byte buffer, little endian):
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `WEFT` |
//! | 4..6 | format version ([`HANDLE_VERSION`]) |
//! | 6 | address length (<= [`MAX_ADDR`]) |
//! | 7 | reserved, 0 |
//! | 8..16 | listener nonce (random per `listen`) |
//! | 16..20 | check value: FNV-1a over bytes 0..16 and the address |
//! | 20..20+len | the listener endpoint's libfabric address |
//! | 112..128 | connect stage: written by `connect` while it is in progress |
//!
//! Control messages carry [`CTRL_MAGIC`], a kind and a body; every field is
//! checked on receipt, so a truncated or forged message is refused with a
//! message and changes nothing.

/// Size of NCCL's handle buffer (`NCCL_NET_HANDLE_MAXSIZE`).
pub const HANDLE_SIZE: usize = 128;
/// First bytes of every Weft handle.
pub const HANDLE_MAGIC: [u8; 4] = *b"WEFT";
/// Version of the handle and handshake format.
pub const HANDLE_VERSION: u16 = 1;
/// Largest endpoint address a handle carries.
pub const MAX_ADDR: usize = 92;
/// Where `connect` keeps its in-progress state inside the handle.
pub const STAGE_OFFSET: usize = 112;
/// Marks a connect stage in progress.
pub const STAGE_MAGIC: u32 = 0x5745_4654 ^ 0xC0;
/// First bytes of every control message.
pub const CTRL_MAGIC: u32 = 0x5746_5443; // "WFTC"
/// Largest control message.
pub const CTRL_MAX: usize = 128;

/// FNV-1a, 32 bit: a check value for handles (not security, corruption only).
pub fn fnv1a(parts: &[&[u8]]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for p in parts {
        for &b in *p {
            h ^= u32::from(b);
            h = h.wrapping_mul(0x0100_0193);
        }
    }
    h
}

/// What a listen handle says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenHandle {
    /// Random per listen; echoed in the handshake.
    pub nonce: u64,
    /// The listener endpoint's address.
    pub addr: Vec<u8>,
}

/// Why a handle was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandleError {
    /// Not written by Weft (another plugin, garbage, or zeroes).
    #[error("the connection handle was not written by Weft (magic {0:02x?}); both ranks must load the same plugin (check NCCL_NET_PLUGIN / NCCL_NET)")]
    NotWeft([u8; 4]),
    /// Written by another Weft release with a different format.
    #[error("the connection handle has Weft format version {0}, this Weft speaks {HANDLE_VERSION}; deploy the same Weft build on every node")]
    Version(u16),
    /// The address length is impossible.
    #[error("the connection handle is corrupted: address length {0} (must be 1 ..= {MAX_ADDR})")]
    AddrLen(usize),
    /// The check value does not match.
    #[error(
        "the connection handle is corrupted: check value {found:#010x}, expected {expected:#010x}"
    )]
    Check {
        /// Stored.
        found: u32,
        /// Computed.
        expected: u32,
    },
    /// The address does not fit a handle.
    #[error("endpoint address of {0} bytes does not fit a handle (at most {MAX_ADDR})")]
    TooLong(usize),
}

impl ListenHandle {
    /// Writes the handle into NCCL's buffer (the stage area is cleared).
    pub fn encode(&self, out: &mut [u8; HANDLE_SIZE]) -> Result<(), HandleError> {
        if self.addr.len() > MAX_ADDR {
            return Err(HandleError::TooLong(self.addr.len()));
        }
        out.fill(0);
        out[0..4].copy_from_slice(&HANDLE_MAGIC);
        out[4..6].copy_from_slice(&HANDLE_VERSION.to_le_bytes());
        out[6] = self.addr.len() as u8;
        out[8..16].copy_from_slice(&self.nonce.to_le_bytes());
        let check = fnv1a(&[&out[0..16], &self.addr]);
        out[16..20].copy_from_slice(&check.to_le_bytes());
        out[20..20 + self.addr.len()].copy_from_slice(&self.addr);
        Ok(())
    }

    /// Reads and validates a handle.
    pub fn decode(h: &[u8; HANDLE_SIZE]) -> Result<Self, HandleError> {
        let magic: [u8; 4] = h[0..4].try_into().expect("4 bytes");
        if magic != HANDLE_MAGIC {
            return Err(HandleError::NotWeft(magic));
        }
        let version = u16::from_le_bytes([h[4], h[5]]);
        if version != HANDLE_VERSION {
            return Err(HandleError::Version(version));
        }
        let len = usize::from(h[6]);
        if len == 0 || len > MAX_ADDR || h[7] != 0 {
            return Err(HandleError::AddrLen(len));
        }
        let addr = h[20..20 + len].to_vec();
        let found = u32::from_le_bytes(h[16..20].try_into().expect("4 bytes"));
        let expected = fnv1a(&[&h[0..16], &addr]);
        if found != expected {
            return Err(HandleError::Check { found, expected });
        }
        Ok(Self {
            nonce: u64::from_le_bytes(h[8..16].try_into().expect("8 bytes")),
            addr,
        })
    }
}

/// Reads the connect stage: `Ok(None)` if none, `Ok(Some(ptr))` if one is in
/// progress, `Err` if the area holds garbage.
pub fn read_stage(h: &[u8; HANDLE_SIZE]) -> Result<Option<usize>, HandleError> {
    let s = &h[STAGE_OFFSET..];
    if s.iter().all(|&b| b == 0) {
        return Ok(None);
    }
    let magic = u32::from_le_bytes(s[0..4].try_into().expect("4 bytes"));
    let ptr = u64::from_le_bytes(s[8..16].try_into().expect("8 bytes"));
    if magic != STAGE_MAGIC || ptr == 0 {
        let expected = STAGE_MAGIC;
        return Err(HandleError::Check {
            found: magic,
            expected,
        });
    }
    Ok(Some(ptr as usize))
}

/// Records (or, with `None`, clears) the connect stage.
pub fn write_stage(h: &mut [u8; HANDLE_SIZE], ptr: Option<usize>) {
    let s = &mut h[STAGE_OFFSET..];
    s.fill(0);
    if let Some(p) = ptr {
        s[0..4].copy_from_slice(&STAGE_MAGIC.to_le_bytes());
        s[8..16].copy_from_slice(&(p as u64).to_le_bytes());
    }
}

/// A control message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ctrl {
    /// connect -> listener: "here is my endpoint".
    Conn {
        /// The listener nonce from the handle.
        listener: u64,
        /// Random per connect; echoed by the Ack.
        conn: u64,
        /// The sender endpoint's address.
        addr: Vec<u8>,
    },
    /// new receive comm -> connect: "send your data here".
    Ack {
        /// The Conn's nonce.
        conn: u64,
        /// Messages the sender may have outstanding before credits return.
        credits: u32,
        /// The receive endpoint's address.
        addr: Vec<u8>,
    },
    /// receiver -> sender: this many more messages may be sent.
    Credit {
        /// Credits returned.
        count: u32,
    },
    /// Either side -> the other: "I am alive". Sent every heartbeat period;
    /// the connecting side's first one also completes the handshake.
    Alive,
}

/// Why a control message was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CtrlError {
    /// Shorter than its fixed part or its stated address.
    #[error("truncated control message ({0} bytes)")]
    Truncated(usize),
    /// Wrong magic: not from Weft.
    #[error("control message with a foreign magic {0:#010x}")]
    Magic(u32),
    /// Unknown format version.
    #[error("control message of format version {0}, expected {HANDLE_VERSION}")]
    Version(u16),
    /// Unknown kind.
    #[error("control message of unknown kind {0}")]
    Kind(u8),
    /// Address too long.
    #[error("control message with an address of {0} bytes (must be 1 ..= {MAX_ADDR})")]
    AddrLen(usize),
}

const KIND_CONN: u8 = 1;
const KIND_ACK: u8 = 2;
const KIND_CREDIT: u8 = 3;
const KIND_ALIVE: u8 = 4;

impl Ctrl {
    /// Encodes into `out`, returning the length used.
    pub fn encode(&self, out: &mut [u8; CTRL_MAX]) -> usize {
        out[0..4].copy_from_slice(&CTRL_MAGIC.to_le_bytes());
        out[4..6].copy_from_slice(&HANDLE_VERSION.to_le_bytes());
        let put_addr = |out: &mut [u8; CTRL_MAX], at: usize, addr: &[u8]| {
            let n = addr.len().min(MAX_ADDR);
            out[7] = n as u8;
            out[at..at + n].copy_from_slice(&addr[..n]);
            at + n
        };
        match self {
            Ctrl::Conn {
                listener,
                conn,
                addr,
            } => {
                out[6] = KIND_CONN;
                out[8..16].copy_from_slice(&listener.to_le_bytes());
                out[16..24].copy_from_slice(&conn.to_le_bytes());
                put_addr(out, 24, addr)
            }
            Ctrl::Ack {
                conn,
                credits,
                addr,
            } => {
                out[6] = KIND_ACK;
                out[8..16].copy_from_slice(&conn.to_le_bytes());
                out[16..20].copy_from_slice(&credits.to_le_bytes());
                out[20..24].fill(0);
                put_addr(out, 24, addr)
            }
            Ctrl::Credit { count } => {
                out[6] = KIND_CREDIT;
                out[7] = 0;
                out[8..12].copy_from_slice(&count.to_le_bytes());
                12
            }
            Ctrl::Alive => {
                out[6] = KIND_ALIVE;
                out[7] = 0;
                out[8..12].fill(0);
                12
            }
        }
    }

    /// Decodes and validates `buf` (exactly the received bytes).
    pub fn decode(buf: &[u8]) -> Result<Self, CtrlError> {
        if buf.len() < 12 {
            return Err(CtrlError::Truncated(buf.len()));
        }
        let magic = u32::from_le_bytes(buf[0..4].try_into().expect("4 bytes"));
        if magic != CTRL_MAGIC {
            return Err(CtrlError::Magic(magic));
        }
        let version = u16::from_le_bytes([buf[4], buf[5]]);
        if version != HANDLE_VERSION {
            return Err(CtrlError::Version(version));
        }
        let u64_at = |i: usize| u64::from_le_bytes(buf[i..i + 8].try_into().expect("8 bytes"));
        let addr = || {
            let n = usize::from(buf[7]);
            if n == 0 || n > MAX_ADDR {
                return Err(CtrlError::AddrLen(n));
            }
            buf.get(24..24 + n)
                .map(<[u8]>::to_vec)
                .ok_or(CtrlError::Truncated(buf.len()))
        };
        match buf[6] {
            KIND_CONN if buf.len() >= 24 => Ok(Ctrl::Conn {
                listener: u64_at(8),
                conn: u64_at(16),
                addr: addr()?,
            }),
            KIND_ACK if buf.len() >= 24 => Ok(Ctrl::Ack {
                conn: u64_at(8),
                credits: u32::from_le_bytes(buf[16..20].try_into().expect("4 bytes")),
                addr: addr()?,
            }),
            KIND_CREDIT => Ok(Ctrl::Credit {
                count: u32::from_le_bytes(buf[8..12].try_into().expect("4 bytes")),
            }),
            KIND_ALIVE => Ok(Ctrl::Alive),
            KIND_CONN | KIND_ACK => Err(CtrlError::Truncated(buf.len())),
            k => Err(CtrlError::Kind(k)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn handle() -> [u8; HANDLE_SIZE] {
        let mut h = [0u8; HANDLE_SIZE];
        ListenHandle {
            nonce: 0x1122_3344_5566_7788,
            addr: vec![2, 0, 0x1f, 0x90, 127, 0, 0, 1],
        }
        .encode(&mut h)
        .unwrap();
        h
    }

    #[test]
    fn handle_round_trips_and_stage_is_separate() {
        let mut h = handle();
        let d = ListenHandle::decode(&h).unwrap();
        assert_eq!(d.nonce, 0x1122_3344_5566_7788);
        assert_eq!(d.addr.len(), 8);
        assert_eq!(read_stage(&h), Ok(None));
        write_stage(&mut h, Some(0xdead_beef));
        assert_eq!(read_stage(&h), Ok(Some(0xdead_beef)));
        assert_eq!(
            ListenHandle::decode(&h).unwrap(),
            d,
            "the stage is not covered by the check"
        );
        write_stage(&mut h, None);
        assert_eq!(read_stage(&h), Ok(None));
    }

    #[test]
    fn foreign_versioned_and_corrupted_handles_are_refused() {
        assert!(matches!(
            ListenHandle::decode(&[0u8; HANDLE_SIZE]),
            Err(HandleError::NotWeft(_))
        ));
        let mut other = [0u8; HANDLE_SIZE];
        other[..4].copy_from_slice(b"NCCL");
        assert!(matches!(
            ListenHandle::decode(&other),
            Err(HandleError::NotWeft(_))
        ));
        let mut v2 = handle();
        v2[4] = 2;
        assert_eq!(ListenHandle::decode(&v2), Err(HandleError::Version(2)));
        let mut bad_len = handle();
        bad_len[6] = 200;
        assert_eq!(
            ListenHandle::decode(&bad_len),
            Err(HandleError::AddrLen(200))
        );
        let mut flipped = handle();
        flipped[21] ^= 1;
        assert!(matches!(
            ListenHandle::decode(&flipped),
            Err(HandleError::Check { .. })
        ));
        let mut stage = handle();
        stage[STAGE_OFFSET + 3] = 9;
        assert!(read_stage(&stage).is_err());
        let msg = ListenHandle::decode(&other).unwrap_err().to_string();
        assert!(msg.contains("same plugin"), "{msg}");
    }

    /// An empty address is refused even with a consistent check value, in
    /// a handle, a Conn and an Ack (libfabric would read a whole address
    /// from an empty buffer).
    #[test]
    fn empty_addresses_are_refused() {
        let mut h = [0u8; HANDLE_SIZE];
        ListenHandle {
            nonce: 9,
            addr: Vec::new(),
        }
        .encode(&mut h)
        .unwrap();
        assert_eq!(ListenHandle::decode(&h), Err(HandleError::AddrLen(0)));
        for msg in [
            Ctrl::Conn {
                listener: 1,
                conn: 2,
                addr: Vec::new(),
            },
            Ctrl::Ack {
                conn: 2,
                credits: 3,
                addr: Vec::new(),
            },
        ] {
            let mut b = [0u8; CTRL_MAX];
            let n = msg.encode(&mut b);
            assert_eq!(Ctrl::decode(&b[..n]), Err(CtrlError::AddrLen(0)));
        }
    }

    #[test]
    fn ctrl_round_trips() {
        let mut b = [0u8; CTRL_MAX];
        for m in [
            Ctrl::Conn {
                listener: 1,
                conn: 2,
                addr: vec![9; 16],
            },
            Ctrl::Ack {
                conn: 2,
                credits: 256,
                addr: vec![7; 40],
            },
            Ctrl::Credit { count: 64 },
            Ctrl::Alive,
        ] {
            let n = m.encode(&mut b);
            assert_eq!(Ctrl::decode(&b[..n]).unwrap(), m);
        }
    }

    proptest! {
        /// Any bytes: decoding never panics, and truncating a valid message
        /// never yields a different valid one.
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..160)) {
            let _ = Ctrl::decode(&bytes);
            let mut h = [0u8; HANDLE_SIZE];
            let n = bytes.len().min(HANDLE_SIZE);
            h[..n].copy_from_slice(&bytes[..n]);
            let _ = ListenHandle::decode(&h);
            let _ = read_stage(&h);
        }

        #[test]
        fn truncated_conn_is_refused(cut in 0usize..40) {
            let mut b = [0u8; CTRL_MAX];
            let n = Ctrl::Conn { listener: 5, conn: 6, addr: vec![1; 16] }.encode(&mut b);
            prop_assume!(cut < n);
            prop_assert!(Ctrl::decode(&b[..cut]).is_err());
        }
    }
}
