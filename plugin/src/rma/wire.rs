//! What RMA ranks say to one another: the listen handle NCCL all-gathers,
//! and the control messages (the body after the hub's [`CTRL_HEAD`] bytes
//! of comm id and token).
//!
//! Every message starts with [`MAGIC`] and a kind byte; integers are little
//! endian. Decoding checks lengths and kinds and never panics: a peer's
//! bytes are not trusted.
//!
//! [`CTRL_HEAD`]: crate::proto::ctrl::CTRL_HEAD

#![forbid(unsafe_code)]

use crate::nccl::HANDLE_SIZE;

/// First bytes of an RMA listen handle ("WFRA").
pub const HANDLE_MAGIC: [u8; 4] = *b"WFRA";
/// First bytes of every RMA control message ("WFRM").
pub const MAGIC: [u8; 4] = *b"WFRM";
/// The largest endpoint name a handle carries.
pub const MAX_NAME: usize = HANDLE_SIZE - HANDLE_HEAD;
/// Handle bytes before the name: magic, secret (8), listen id (4), name length (2).
const HANDLE_HEAD: usize = 4 + 8 + 4 + 2;

/// A listen handle: where a rank's RMA listener is (its device's passive
/// endpoint and the listener's comm id there), and the secret a `Hello`
/// must carry to be taken (only the group, which NCCL's bootstrap gave
/// the handles to, knows it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handle {
    /// Drawn at random by the listener.
    pub secret: u64,
    /// The listener's comm id on its hub.
    pub id: u32,
    /// The hub's passive endpoint name.
    pub name: Vec<u8>,
}

/// Why bytes are not an RMA handle or message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Not made by Weft's RMA tables.
    #[error("not a Weft RMA handle or message (magic {0:02x?})")]
    Magic([u8; 4]),
    /// Too short for its kind.
    #[error("truncated: {0} bytes")]
    Truncated(usize),
    /// An endpoint name longer than a handle holds.
    #[error("an endpoint name of {0} bytes (at most {MAX_NAME})")]
    Name(usize),
    /// An unknown message kind.
    #[error("unknown message kind {0}")]
    Kind(u8),
    /// Flags this version does not know.
    #[error("unknown flags {0:#x}")]
    Flags(u32),
}

impl Handle {
    /// Writes it into NCCL's handle buffer.
    pub fn encode(&self, out: &mut [u8; HANDLE_SIZE]) -> Result<(), WireError> {
        if self.name.len() > MAX_NAME {
            return Err(WireError::Name(self.name.len()));
        }
        out.fill(0);
        out[..4].copy_from_slice(&HANDLE_MAGIC);
        out[4..12].copy_from_slice(&self.secret.to_le_bytes());
        out[12..16].copy_from_slice(&self.id.to_le_bytes());
        out[16..18].copy_from_slice(&(self.name.len() as u16).to_le_bytes());
        out[HANDLE_HEAD..HANDLE_HEAD + self.name.len()].copy_from_slice(&self.name);
        Ok(())
    }

    /// Reads one (a rank's, as NCCL's bootstrap all-gathered it).
    pub fn decode(b: &[u8; HANDLE_SIZE]) -> Result<Self, WireError> {
        let magic: [u8; 4] = b[..4].try_into().expect("4 bytes");
        if magic != HANDLE_MAGIC {
            return Err(WireError::Magic(magic));
        }
        let len = u16::from_le_bytes([b[16], b[17]]) as usize;
        if len > MAX_NAME {
            return Err(WireError::Name(len));
        }
        Ok(Self {
            secret: u64::from_le_bytes(b[4..12].try_into().expect("8 bytes")),
            id: u32::from_le_bytes(b[12..16].try_into().expect("4 bytes")),
            name: b[HANDLE_HEAD..HANDLE_HEAD + len].to_vec(),
        })
    }
}

/// A control message between the ranks of one collComm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Msg {
    /// To a rank's listener, during `connect`: "I am rank `rank` of
    /// `nranks`; what you send me goes to my comm `id`, and what I send
    /// you carries `token`".
    Hello {
        /// The listener's secret (from its handle).
        secret: u64,
        /// The sender's rank.
        rank: u32,
        /// The group's size, as the sender knows it.
        nranks: u32,
        /// The sender's comm id for what the listener's rank sends it.
        id: u32,
        /// The token on everything the sender sends.
        token: u32,
        /// The sender's provider loses a write's remote CQ data: write to
        /// it without any, and its signals wait for no count (a signal sent
        /// after a write arrives after its data: FI_ORDER_SAW).
        announce: bool,
    },
    /// During `regMrSym`: the sender's registration number `seq` of the
    /// collComm is `len` bytes at `addr`, remote key `key`, its
    /// registration starting at `base` (offset addressing counts from it).
    Key {
        /// Registration number (the same on every rank: symmetric calls).
        seq: u32,
        /// Where NCCL's range starts in the sender's address space.
        addr: u64,
        /// NCCL's size.
        len: u64,
        /// The remote key.
        key: u64,
        /// Where the provider's registration starts.
        base: u64,
    },
    /// Add `value` to the 64-bit signal at `off` in registration `seq`,
    /// once `puts` writes from the sender have landed.
    Signal {
        /// Writes the sender had issued to this rank, this one's included.
        puts: u64,
        /// The signal registration's number.
        seq: u32,
        /// Offset of the signal in it.
        off: u64,
        /// What to add.
        value: u64,
    },
}

const HELLO: u8 = 1;
const KEY: u8 = 2;
const SIGNAL: u8 = 3;
/// `Hello`'s flag: the sender loses a write's remote CQ data.
const ANNOUNCE: u32 = 1;

/// The largest encoded message.
pub const MSG_MAX: usize = 5 + 8 * 4 + 4;

impl Msg {
    /// Encodes it into `out`; returns the length.
    pub fn encode(&self, out: &mut [u8; MSG_MAX]) -> usize {
        out[..4].copy_from_slice(&MAGIC);
        let mut w = Writer { b: out, at: 5 };
        out_kind(&mut w, self);
        w.at
    }

    /// Decodes a message.
    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        let magic: [u8; 4] = b
            .get(..4)
            .ok_or(WireError::Truncated(b.len()))?
            .try_into()
            .expect("4 bytes");
        if magic != MAGIC {
            return Err(WireError::Magic(magic));
        }
        let kind = *b.get(4).ok_or(WireError::Truncated(b.len()))?;
        let mut r = Reader { b, at: 5 };
        let m = match kind {
            HELLO => Msg::Hello {
                secret: r.u64()?,
                rank: r.u32()?,
                nranks: r.u32()?,
                id: r.u32()?,
                token: r.u32()?,
                announce: match r.u32()? {
                    0 => false,
                    ANNOUNCE => true,
                    f => return Err(WireError::Flags(f)),
                },
            },
            KEY => Msg::Key {
                seq: r.u32()?,
                addr: r.u64()?,
                len: r.u64()?,
                key: r.u64()?,
                base: r.u64()?,
            },
            SIGNAL => Msg::Signal {
                puts: r.u64()?,
                seq: r.u32()?,
                off: r.u64()?,
                value: r.u64()?,
            },
            k => return Err(WireError::Kind(k)),
        };
        Ok(m)
    }
}

fn out_kind(w: &mut Writer<'_>, m: &Msg) {
    match *m {
        Msg::Hello {
            secret,
            rank,
            nranks,
            id,
            token,
            announce,
        } => {
            w.b[4] = HELLO;
            w.u64(secret);
            w.u32(rank);
            w.u32(nranks);
            w.u32(id);
            w.u32(token);
            w.u32(if announce { ANNOUNCE } else { 0 });
        }
        Msg::Key {
            seq,
            addr,
            len,
            key,
            base,
        } => {
            w.b[4] = KEY;
            w.u32(seq);
            w.u64(addr);
            w.u64(len);
            w.u64(key);
            w.u64(base);
        }
        Msg::Signal {
            puts,
            seq,
            off,
            value,
        } => {
            w.b[4] = SIGNAL;
            w.u64(puts);
            w.u32(seq);
            w.u64(off);
            w.u64(value);
        }
    }
}

struct Writer<'a> {
    b: &'a mut [u8; MSG_MAX],
    at: usize,
}

impl Writer<'_> {
    fn u32(&mut self, v: u32) {
        self.b[self.at..self.at + 4].copy_from_slice(&v.to_le_bytes());
        self.at += 4;
    }
    fn u64(&mut self, v: u64) {
        self.b[self.at..self.at + 8].copy_from_slice(&v.to_le_bytes());
        self.at += 8;
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let s = self
            .b
            .get(self.at..self.at + N)
            .ok_or(WireError::Truncated(self.b.len()))?;
        self.at += N;
        Ok(s.try_into().expect("N bytes"))
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        self.take::<4>().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        self.take::<8>().map(u64::from_le_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_truncations_are_refused() {
        let msgs = [
            Msg::Hello {
                secret: u64::MAX - 3,
                rank: 3,
                nranks: 4,
                id: 0xAB_CDEF,
                token: 77,
                announce: false,
            },
            Msg::Hello {
                secret: 1,
                rank: 0,
                nranks: 2,
                id: 4,
                token: 9,
                announce: true,
            },
            Msg::Key {
                seq: 9,
                addr: 0x7f00_0000_1000,
                len: 1 << 26,
                key: 42,
                base: 0x7f00_0000_0000,
            },
            Msg::Signal {
                puts: 1_000_001,
                seq: 2,
                off: 24,
                value: 5,
            },
        ];
        for m in msgs {
            let mut b = [0u8; MSG_MAX];
            let n = m.encode(&mut b);
            assert_eq!(Msg::decode(&b[..n]), Ok(m));
            for cut in 0..n {
                assert!(Msg::decode(&b[..cut]).is_err(), "{m:?} cut at {cut}");
            }
        }
        let mut b = [0u8; MSG_MAX];
        let n = msgs[0].encode(&mut b);
        b[n - 4] = 2;
        assert_eq!(Msg::decode(&b[..n]), Err(WireError::Flags(2)));
        let n = msgs[3].encode(&mut b);
        b[4] = 99;
        assert_eq!(Msg::decode(&b[..n]), Err(WireError::Kind(99)));
        b[0] = b'X';
        assert!(matches!(Msg::decode(&b[..n]), Err(WireError::Magic(_))));
    }

    #[test]
    fn handles_round_trip_and_forgeries_are_refused() {
        let h = Handle {
            secret: 0x1234_5678_9abc_def0,
            id: 5,
            name: vec![7; 40],
        };
        let mut b = [0u8; HANDLE_SIZE];
        h.encode(&mut b).unwrap();
        assert_eq!(Handle::decode(&b), Ok(h));
        let long = Handle {
            secret: 0,
            id: 0,
            name: vec![0; MAX_NAME + 1],
        };
        assert_eq!(long.encode(&mut b), Err(WireError::Name(MAX_NAME + 1)));
        let mut forged = [0u8; HANDLE_SIZE];
        forged[..4].copy_from_slice(&HANDLE_MAGIC);
        forged[16..18].copy_from_slice(&(MAX_NAME as u16 + 1).to_le_bytes());
        assert_eq!(Handle::decode(&forged), Err(WireError::Name(MAX_NAME + 1)));
        assert!(matches!(
            Handle::decode(&[0u8; HANDLE_SIZE]),
            Err(WireError::Magic(_))
        ));
    }

    proptest::proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64)) {
            let _ = Msg::decode(&bytes);
        }
    }
}
