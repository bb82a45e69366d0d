//! What CollNet ranks and reducers say to each other besides data: the
//! greeting that opens each comm of a group, the join a rank sends a
//! reducer, and the header that opens each all-reduce at a reducer. All
//! little-endian, fixed size, checked field by field on arrival: a peer's
//! garbage is an error naming the field, never a crash or a wrong reduction.

#![forbid(unsafe_code)]

use crate::nccl::HANDLE_SIZE;

use super::reduce::{DataType, RedOp};

/// The greeting a reducer sends on its comm to a rank: this bit and its
/// index. A rank's greeting is its rank (below this bit).
pub const REDUCER_BIT: u64 = 1 << 63;

/// Bytes of a greeting.
pub const GREETING_LEN: usize = 8;

/// Tag of the greeting (and of a reducer's join) on a new group's comms.
pub const HELLO_TAG: i32 = 0x7fff_fff0;
/// Tag of the header that opens an all-reduce at a reducer.
pub const HEADER_TAG: i32 = 0x7fff_ffe0;

const JOIN_MAGIC: u32 = u32::from_le_bytes(*b"WFRJ");
const HEADER_MAGIC: u32 = u32::from_le_bytes(*b"WFRH");
const VERSION: u16 = 1;

/// The most ranks a reducer serves in one group, and reducers per group.
pub const MAX_RANKS: u32 = 1 << 16;
pub const MAX_REDUCERS: u32 = 256;
/// The largest chunk a header may announce (a reducer allocates
/// `(ranks + 1) x chunk` per chunk in flight).
pub const MAX_CHUNK: u32 = 16 << 20;

/// A malformed message from a peer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed CollNet {what}: {why}")]
pub struct Malformed {
    /// Which message.
    pub what: &'static str,
    /// Which field, and what was wrong with it.
    pub why: String,
}

fn bad(what: &'static str, why: impl Into<String>) -> Malformed {
    Malformed {
        what,
        why: why.into(),
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().expect("2 bytes"))
}
/// Checks what every message starts with: exactly `len` bytes, `magic`
/// first (`bad_magic` says what a wrong one means).
fn framed(
    b: &[u8],
    what: &'static str,
    len: usize,
    magic: u32,
    bad_magic: &str,
) -> Result<(), Malformed> {
    if b.len() != len {
        return Err(bad(what, format!("{} bytes, not {len}", b.len())));
    }
    if u32_at(b, 0) != magic {
        return Err(bad(what, bad_magic));
    }
    Ok(())
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// A rank's request to join a reducer: which group (a key every rank of it
/// computes alike), its rank, the group's size, which of the group's
/// reducers it takes this one for, and its own listen handle, which the
/// reducer connects back to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Join {
    pub key: u64,
    pub rank: u32,
    pub nranks: u32,
    pub index: u32,
    pub nreducers: u32,
    pub handle: [u8; HANDLE_SIZE],
}

impl Join {
    /// Encoded size.
    pub const LEN: usize = 32 + HANDLE_SIZE;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..4].copy_from_slice(&JOIN_MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[8..16].copy_from_slice(&self.key.to_le_bytes());
        b[16..20].copy_from_slice(&self.rank.to_le_bytes());
        b[20..24].copy_from_slice(&self.nranks.to_le_bytes());
        b[24..28].copy_from_slice(&self.index.to_le_bytes());
        b[28..32].copy_from_slice(&self.nreducers.to_le_bytes());
        b[32..].copy_from_slice(&self.handle);
        b
    }

    pub fn decode(b: &[u8]) -> Result<Self, Malformed> {
        const W: &str = "join";
        framed(
            b,
            W,
            Self::LEN,
            JOIN_MAGIC,
            "bad magic (not a Weft CollNet rank?)",
        )?;
        if u16_at(b, 4) != VERSION {
            return Err(bad(
                W,
                format!(
                    "version {} (this reducer speaks {VERSION}; run the same Weft on ranks and reducers)",
                    u16_at(b, 4)
                ),
            ));
        }
        let j = Join {
            key: u64_at(b, 8),
            rank: u32_at(b, 16),
            nranks: u32_at(b, 20),
            index: u32_at(b, 24),
            nreducers: u32_at(b, 28),
            handle: b[32..].try_into().expect("handle bytes"),
        };
        if j.nranks == 0 || j.nranks > MAX_RANKS || j.rank >= j.nranks {
            return Err(bad(W, format!("rank {} of {}", j.rank, j.nranks)));
        }
        if j.nreducers == 0 || j.nreducers > MAX_REDUCERS || j.index >= j.nreducers {
            return Err(bad(W, format!("reducer {} of {}", j.index, j.nreducers)));
        }
        Ok(j)
    }
}

/// What opens an all-reduce at a reducer: the operation's number, type and
/// op, the shard this reducer reduces (offset and length in bytes of the
/// operation's buffer) and the chunk size it travels in. Every rank sends
/// the same header; the reducer checks that they agree. A header with
/// `bye` set instead says the rank closes the group (`closeColl`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub bye: bool,
    pub seq: u32,
    pub ty: DataType,
    pub op: RedOp,
    pub total: u64,
    pub off: u64,
    pub len: u64,
    pub chunk: u32,
}

impl Header {
    /// Encoded size.
    pub const LEN: usize = 48;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..4].copy_from_slice(&HEADER_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8] = self.ty as u8;
        b[9] = self.op as u8;
        b[10] = u8::from(self.bye);
        b[16..24].copy_from_slice(&self.total.to_le_bytes());
        b[24..32].copy_from_slice(&self.off.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b[40..44].copy_from_slice(&self.chunk.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Self, Malformed> {
        const W: &str = "all-reduce header";
        framed(b, W, Self::LEN, HEADER_MAGIC, "bad magic")?;
        let ty = DataType::from_nccl(i32::from(b[8]))
            .ok_or_else(|| bad(W, format!("unknown data type {}", b[8])))?;
        let op = RedOp::from_nccl(i32::from(b[9]))
            .ok_or_else(|| bad(W, format!("unknown reduction op {}", b[9])))?;
        if b[10] > 1 {
            return Err(bad(W, format!("bye flag {}", b[10])));
        }
        let h = Header {
            bye: b[10] == 1,
            seq: u32_at(b, 4),
            ty,
            op,
            total: u64_at(b, 16),
            off: u64_at(b, 24),
            len: u64_at(b, 32),
            chunk: u32_at(b, 40),
        };
        let size = ty.size() as u64;
        if h.chunk == 0 || h.chunk > MAX_CHUNK || u64::from(h.chunk) % size != 0 {
            return Err(bad(
                W,
                format!(
                    "chunk of {} bytes (1 ..= {MAX_CHUNK}, whole {size}-byte elements)",
                    h.chunk
                ),
            ));
        }
        if h.off.checked_add(h.len).is_none_or(|e| e > h.total)
            || h.off % size != 0
            || h.len % size != 0
        {
            return Err(bad(
                W,
                format!(
                    "shard of {} bytes at {} in {} bytes of {size}-byte elements",
                    h.len, h.off, h.total
                ),
            ));
        }
        Ok(h)
    }
}

/// The key that names a group at its reducers: FNV-1a over every rank's
/// listen handle, which every rank of the group is given alike.
pub fn group_key(handles: &[[u8; HANDLE_SIZE]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in handles.iter().flatten() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn join() -> Join {
        Join {
            key: 0x1234_5678_9abc_def0,
            rank: 2,
            nranks: 4,
            index: 1,
            nreducers: 2,
            handle: [7u8; HANDLE_SIZE],
        }
    }

    fn header() -> Header {
        Header {
            bye: false,
            seq: 9,
            ty: DataType::Bf16,
            op: RedOp::Max,
            total: 4000,
            off: 2000,
            len: 2000,
            chunk: 1 << 20,
        }
    }

    #[test]
    fn round_trips() {
        assert_eq!(Join::decode(&join().encode()), Ok(join()));
        assert_eq!(Header::decode(&header().encode()), Ok(header()));
        let bye = Header {
            bye: true,
            ..header()
        };
        assert_eq!(Header::decode(&bye.encode()), Ok(bye));
        use crate::nccl::{handle_from_hex, hex};
        let h = [0xa5u8; HANDLE_SIZE];
        assert_eq!(handle_from_hex(&format!(" {}\n", hex(&h))), Some(h));
        assert_eq!(handle_from_hex("abc"), None);
        assert_eq!(handle_from_hex(&"ab".repeat(HANDLE_SIZE - 1)), None);
        assert_eq!(handle_from_hex(&"zz".repeat(HANDLE_SIZE)), None);
    }

    #[test]
    fn refuses_what_does_not_fit() {
        let j = join().encode();
        assert!(Join::decode(&j[..Join::LEN - 1]).is_err(), "truncated");
        let mut b = j;
        b[0] ^= 1;
        assert!(Join::decode(&b).unwrap_err().why.contains("magic"));
        let mut b = j;
        b[4] = 9;
        assert!(Join::decode(&b).unwrap_err().why.contains("version"));
        let mut b = j;
        b[16..20].copy_from_slice(&4u32.to_le_bytes()); // rank 4 of 4
        assert!(Join::decode(&b).unwrap_err().why.contains("rank 4 of 4"));
        let mut b = j;
        b[24..28].copy_from_slice(&2u32.to_le_bytes()); // reducer 2 of 2
        assert!(Join::decode(&b).is_err());

        let h = header().encode();
        assert!(Header::decode(&h[..40]).is_err(), "truncated");
        let mut b = h;
        b[8] = 200;
        assert!(Header::decode(&b).unwrap_err().why.contains("type"));
        let mut b = h;
        b[10] = 2;
        assert!(Header::decode(&b).unwrap_err().why.contains("bye"));
        let mut b = h;
        b[9] = 77;
        assert!(Header::decode(&b).unwrap_err().why.contains("op"));
        let mut b = h;
        b[40..44].copy_from_slice(&3u32.to_le_bytes()); // not whole bf16s
        assert!(Header::decode(&b).unwrap_err().why.contains("chunk"));
        let mut b = h;
        b[32..40].copy_from_slice(&2002u64.to_le_bytes()); // past the end
        assert!(Header::decode(&b).unwrap_err().why.contains("shard"));
        let mut b = h;
        b[24..32].copy_from_slice(&u64::MAX.to_le_bytes()); // overflows
        assert!(Header::decode(&b).is_err());
    }

    #[test]
    fn the_key_depends_on_every_handle_and_their_order() {
        let a = [[1u8; HANDLE_SIZE], [2u8; HANDLE_SIZE]];
        let b = [[2u8; HANDLE_SIZE], [1u8; HANDLE_SIZE]];
        let mut c = a;
        c[1][HANDLE_SIZE - 1] = 3;
        assert_ne!(group_key(&a), group_key(&b));
        assert_ne!(group_key(&a), group_key(&c));
        assert_eq!(group_key(&a), group_key(&a.clone()));
    }
}
