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
//! | 7 | the listener's protocol ([`PROTO_SENDRECV`], [`PROTO_RDMA`]) |
//! | 8..16 | listener nonce (random per `listen`) |
//! | 16..20 | check value: FNV-1a over bytes 0..16, the address and the id |
//! | 20..20+len | the listener endpoint's libfabric address |
//! | 108..112 | the listener's comm id on its endpoint (0: the endpoint is its own) |
//! | 112..128 | connect stage: written by `connect` while it is in progress |
//!
//! A virtual device's listener (one listener per rail) writes a *rails
//! handle* instead: byte 6 is the number of rails (1 ..= [`MAX_RAILS`]),
//! byte 7 has [`PROTO_RAILS`] set, bytes 8..16 are rail 0's nonce (rail `i`'s
//! is that plus `i`), the check value covers bytes 0..16 and the rails, and
//! bytes 20..112 hold, per rail, its address length, address and listener
//! id (4 bytes). Two or three tcp rails fit, four of 16-byte addresses.
//!
//! Control messages carry [`CTRL_MAGIC`], a kind and a body; every field is
//! checked on receipt, so a truncated or forged message is refused with a
//! message and changes nothing.
//!
//! And the bits Weft packs into what libfabric carries for it: an
//! operation's context ([`context`]: the comm id, 32 bits of the comm's
//! own), a tagged data message's tag ([`data_tag`]: the receive comm's id
//! and NCCL's tag) and a write's immediate ([`immediate`]: the comm id, a
//! slot and buffer, and the size XOR the offer's ticket).

#![forbid(unsafe_code)]

pub use crate::nccl::HANDLE_SIZE;
/// First bytes of every Weft handle.
pub const HANDLE_MAGIC: [u8; 4] = *b"WEFT";
/// Version of the handle and handshake format.
/// 3: tagged receivers announce their large receives ([`Ctrl::Posted`]);
/// a sender of version 2 would not wait for them.
pub const HANDLE_VERSION: u16 = 5;
/// Largest endpoint address a handle carries.
pub const MAX_ADDR: usize = 88;
/// Where the listener's comm id sits in the handle.
pub const ID_OFFSET: usize = 108;
/// Handle protocol byte: SENDRECV.
pub const PROTO_SENDRECV: u8 = 0;
/// Handle protocol byte: RDMA.
pub const PROTO_RDMA: u8 = 1;
/// Handle protocol byte flag: a rails handle (a virtual device's listener).
pub const PROTO_RAILS: u8 = 0x80;
/// Most rails a rails handle lists (`NCCL_NET_MAX_DEVS_PER_NIC` of v12).
pub const MAX_RAILS: usize = 8;
/// Where `connect` keeps its in-progress state inside the handle.
pub const STAGE_OFFSET: usize = 112;
/// Marks a connect stage in progress.
pub const STAGE_MAGIC: u32 = 0x5745_4654 ^ 0xC0;
/// First bytes of every control message.
pub const CTRL_MAGIC: u32 = 0x5746_5443; // "WFTC"
/// Largest control message (an [`Ctrl::Rtr`] for [`super::MAX_RECVS`] buffers).
pub const CTRL_MAX: usize = 320;

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
    /// The listener's comm id on that endpoint (0 if the endpoint is its own).
    pub id: u32,
    /// The listener's protocol ([`PROTO_SENDRECV`] or [`PROTO_RDMA`]).
    pub proto: u8,
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
    /// The rails' addresses do not fit one handle together.
    #[error("the rails' endpoint addresses take {0} bytes together, more than a handle holds ({RAILS_ROOM}); make the virtual device of fewer rails")]
    RailsTooLong(usize),
    /// A rails handle that lists an impossible number of rails, or whose
    /// rails do not parse.
    #[error("the connection handle is corrupted: {0}")]
    Rails(String),
}

/// Room for the rails in a rails handle.
const RAILS_ROOM: usize = STAGE_OFFSET - 20;

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
        out[7] = self.proto;
        out[8..16].copy_from_slice(&self.nonce.to_le_bytes());
        let id = self.id.to_le_bytes();
        let check = fnv1a(&[&out[0..16], &self.addr, &id]);
        out[16..20].copy_from_slice(&check.to_le_bytes());
        out[20..20 + self.addr.len()].copy_from_slice(&self.addr);
        out[ID_OFFSET..ID_OFFSET + 4].copy_from_slice(&id);
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
        if h[7] & PROTO_RAILS != 0 {
            return Err(HandleError::Rails(
                "a virtual device's handle where one device's was expected".into(),
            ));
        }
        let len = usize::from(h[6]);
        if len == 0 || len > MAX_ADDR {
            return Err(HandleError::AddrLen(len));
        }
        let addr = h[20..20 + len].to_vec();
        let id: [u8; 4] = h[ID_OFFSET..ID_OFFSET + 4].try_into().expect("4 bytes");
        let found = u32::from_le_bytes(h[16..20].try_into().expect("4 bytes"));
        let expected = fnv1a(&[&h[0..16], &addr, &id]);
        if found != expected {
            return Err(HandleError::Check { found, expected });
        }
        Ok(Self {
            nonce: u64::from_le_bytes(h[8..16].try_into().expect("8 bytes")),
            addr,
            id: u32::from_le_bytes(id),
            proto: h[7],
        })
    }
}

/// Writes the rails handle of a virtual device's listener (one listener
/// per rail, rail `i`'s nonce rail 0's plus `i`, one protocol).
pub fn encode_rails(
    rails: &[ListenHandle],
    out: &mut [u8; HANDLE_SIZE],
) -> Result<(), HandleError> {
    let Some(first) = rails.first() else {
        return Err(HandleError::Rails("no rails".into()));
    };
    if rails.len() > MAX_RAILS {
        return Err(HandleError::Rails(format!(
            "{} rails (at most {MAX_RAILS})",
            rails.len()
        )));
    }
    let mut area = Vec::with_capacity(RAILS_ROOM);
    for (i, r) in rails.iter().enumerate() {
        if r.addr.is_empty() || r.addr.len() > MAX_ADDR {
            return Err(HandleError::TooLong(r.addr.len()));
        }
        if r.nonce != first.nonce.wrapping_add(i as u64) || r.proto != first.proto {
            return Err(HandleError::Rails(format!(
                "rail {i}'s listener does not belong with rail 0's"
            )));
        }
        area.push(r.addr.len() as u8);
        area.extend_from_slice(&r.addr);
        area.extend_from_slice(&r.id.to_le_bytes());
    }
    if area.len() > RAILS_ROOM {
        return Err(HandleError::RailsTooLong(area.len()));
    }
    out.fill(0);
    out[0..4].copy_from_slice(&HANDLE_MAGIC);
    out[4..6].copy_from_slice(&HANDLE_VERSION.to_le_bytes());
    out[6] = rails.len() as u8;
    out[7] = first.proto | PROTO_RAILS;
    out[8..16].copy_from_slice(&first.nonce.to_le_bytes());
    let check = fnv1a(&[&out[0..16], &area]);
    out[16..20].copy_from_slice(&check.to_le_bytes());
    out[20..20 + area.len()].copy_from_slice(&area);
    Ok(())
}

/// Reads a handle, validated: a plain one (one listener, `false`) or a
/// rails handle (a virtual device's listeners, `true`).
pub fn decode_any(h: &[u8; HANDLE_SIZE]) -> Result<(Vec<ListenHandle>, bool), HandleError> {
    if h[0..4] != HANDLE_MAGIC || h[7] & PROTO_RAILS == 0 {
        return ListenHandle::decode(h).map(|one| (vec![one], false));
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    if version != HANDLE_VERSION {
        return Err(HandleError::Version(version));
    }
    let n = usize::from(h[6]);
    if !(1..=MAX_RAILS).contains(&n) {
        return Err(HandleError::Rails(format!("{n} rails (1 ..= {MAX_RAILS})")));
    }
    let nonce = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
    let area = &h[20..STAGE_OFFSET];
    let mut rails = Vec::with_capacity(n);
    let mut at = 0;
    for i in 0..n {
        let Some(&len) = area.get(at) else {
            return Err(HandleError::Rails(format!("rail {i} does not fit")));
        };
        let len = usize::from(len);
        if len == 0 || len > MAX_ADDR || at + 1 + len + 4 > area.len() {
            return Err(HandleError::Rails(format!(
                "rail {i}'s address length {len} does not fit"
            )));
        }
        let addr = area[at + 1..at + 1 + len].to_vec();
        let id = u32::from_le_bytes(area[at + 1 + len..at + 5 + len].try_into().expect("4"));
        at += 5 + len;
        rails.push(ListenHandle {
            nonce: nonce.wrapping_add(i as u64),
            addr,
            id,
            proto: h[7] & !PROTO_RAILS,
        });
    }
    let found = u32::from_le_bytes(h[16..20].try_into().expect("4 bytes"));
    let expected = fnv1a(&[&h[0..16], &area[..at]]);
    if found != expected {
        return Err(HandleError::Check { found, expected });
    }
    if area[at..].iter().any(|&b| b != 0) {
        return Err(HandleError::Rails("stray bytes after the rails".into()));
    }
    Ok((rails, true))
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
///
/// An `Rtr` holds its entries inline (336 bytes for the enum), so that
/// decoding one allocates nothing (`tests/tests/alloc.rs`): moving that
/// much costs less than a heap allocation per message.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ctrl {
    /// connect -> listener: "here is my endpoint".
    Conn {
        /// The listener nonce from the handle.
        listener: u64,
        /// Random per connect; echoed by the Ack.
        conn: u64,
        /// The connecting comm's id on its endpoint (0: its own endpoint).
        id: u32,
        /// The sender endpoint's address.
        addr: Vec<u8>,
    },
    /// new receive comm -> connect: "send your data here".
    Ack {
        /// The Conn's nonce.
        conn: u64,
        /// Messages the sender may have outstanding before credits return.
        credits: u32,
        /// RDMA: the largest eager message the receiver takes (0: none).
        /// Below 2^31: the word's top bit carries `announce`.
        eager: u32,
        /// RDMA: the receiver never sees a write's remote CQ data (its
        /// provider loses it), so the sender writes without it and announces
        /// every write with a `Wrote` the provider delivers after the data.
        announce: bool,
        /// The receive comm's id on its endpoint (0: its own endpoint).
        id: u32,
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
    /// Either side -> the other: "I send you nothing more" (sent on close,
    /// and by a send comm in answer to its receiver's Bye once none of its
    /// writes is in flight). Everything its sender sent before it arrives
    /// before it; `sent` counts the tagged data messages a send comm sent
    /// (wrapping), so the receiver still matches those that are on their
    /// way, and fails only what can never come.
    Bye {
        /// Tagged data messages sent on the comm (0 from a receive comm).
        sent: u32,
    },
    /// RDMA receiver -> sender: "ready to receive" into these buffers (one
    /// grouped `irecv`), the `seq`-th such message of the comm.
    Rtr {
        /// Counts the comm's Rtrs from 0 (wrapping), so the sender takes
        /// them in posting order whatever order they arrive in.
        seq: u32,
        /// The receive request's slot (named again by the writes' immediates).
        slot: u8,
        /// Eager credits returned with it (messages consumed since the last
        /// return): the offers going back carry them, so a comm whose
        /// receives are offered sends no `Credit` of its own.
        credits: u16,
        /// The buffers of the receive offered (bit per buffer; a receive
        /// an eager message can fill is not offered unless the sender
        /// asks with a [`Ctrl::Want`]), one entry per set bit, in order.
        subs: u8,
        /// One entry per offered buffer.
        bufs: Entries<RtrBuf>,
    },
    /// RDMA sender -> receiver: "offer me message `idx` of `tag`'s buffer":
    /// the sender has it and cannot send it eagerly (larger than eager
    /// messages go, or out of credits), and no offer came. The receiver
    /// offers that receive now, or once it is posted.
    Want {
        /// NCCL's tag.
        tag: i32,
        /// Which message of that tag (counted from 0 per comm and tag).
        idx: u32,
        /// The message is larger than eager messages go (else the sender
        /// is out of credits): the receiver offers its large receives at
        /// once again (bit 0 of byte 7).
        large: bool,
    },
    /// RDMA sender -> receiver: buffer `sub` of request `slot` gets `size`
    /// bytes (written, or being written, with an immediate naming it).
    Wrote {
        /// The receive request's slot.
        slot: u8,
        /// The buffer within it.
        sub: u8,
        /// Bytes sent.
        size: u64,
    },
    /// RDMA sender -> receiver: message `idx` of `tag` itself, sent before
    /// its buffer was offered (small messages; bounded by credits).
    Eager {
        /// NCCL's tag.
        tag: i32,
        /// Which message of that tag (counted from 0 per comm and tag).
        idx: u32,
        /// The bytes.
        data: Vec<u8>,
    },
    /// RDMA sender -> receiver: the write into buffer `sub` of `slot`
    /// failed in the provider (fi errno `err`; e.g. the buffer was
    /// deregistered under it): that receive fails.
    Failed {
        /// The receive request's slot.
        slot: u8,
        /// The buffer within it.
        sub: u8,
        /// The write's fi errno.
        err: u32,
    },
    /// RDMA sender -> receiver: the message for buffer `sub` of `slot` was
    /// `size` bytes, more than the buffer holds; nothing was written.
    Trunc {
        /// The receive request's slot.
        slot: u8,
        /// The buffer within it.
        sub: u8,
        /// Bytes the sender had.
        size: u64,
    },
    /// Tagged receiver -> sender: receives of these tags are posted with
    /// the provider, `(tag, count)`: `count` receives of `tag` so far
    /// (wrapping). A message larger than the Ack's `eager` goes only into
    /// an announced receive (see the comms module's "Tagged").
    Posted {
        /// 1 ..= [`super::MAX_RECVS`] entries, one per tag.
        counts: Entries<(i32, u32)>,
    },
}

/// The entries of a control message that lists some (at most one per
/// buffer of a grouped receive): held inline, so decoding allocates nothing.
pub type Entries<T> = arrayvec::ArrayVec<T, { super::MAX_RECVS }>;

/// One buffer offered by an [`Ctrl::Rtr`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtrBuf {
    /// NCCL's tag for it.
    pub tag: i32,
    /// Which receive of that tag it is (counted from 0 per comm and tag):
    /// the message of the same number goes into it.
    pub idx: u32,
    /// Its capacity.
    pub size: u64,
    /// Where to write: a virtual address or an offset into the registration,
    /// as the provider's MR mode says.
    pub addr: u64,
    /// The registration's remote key.
    pub key: u64,
    /// A random number drawn for this offer: the write's 8-byte immediate
    /// carries its size XOR this, so a write's immediate forged by anyone
    /// but the peer it was offered to decodes to no valid size.
    pub ticket: u32,
}

/// Bytes of one [`RtrBuf`] on the wire.
const RTR_BUF: usize = 36;
/// Bytes before an eager message's data.
pub const EAGER_HEAD: usize = 16;
/// Where an Rtr's buffers start.
const RTR_HEAD: usize = 16;

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
    /// An Rtr naming no buffers, or more than a grouped receive has.
    #[error("ready-to-receive message with {0} buffers (must be 1 ..= {n})", n = super::MAX_RECVS)]
    RtrCount(usize),
    /// An Rtr whose buffer mask does not name one buffer per entry.
    #[error("ready-to-receive message whose buffer mask {0:#04x} does not name its {1} buffers")]
    RtrSubs(u8, usize),
    /// A Posted naming no tags, or more than a grouped receive has.
    #[error("posted-receives message with {0} tags (must be 1 ..= {n})", n = super::MAX_RECVS)]
    PostedCount(usize),
}

const KIND_CONN: u8 = 1;
const KIND_ACK: u8 = 2;
const KIND_CREDIT: u8 = 3;
const KIND_ALIVE: u8 = 4;
const KIND_RTR: u8 = 5;
const KIND_WROTE: u8 = 6;
const KIND_TRUNC: u8 = 7;
const KIND_BYE: u8 = 8;
const KIND_EAGER: u8 = 9;
const KIND_FAILED: u8 = 10;
const KIND_POSTED: u8 = 11;
const KIND_WANT: u8 = 12;
/// Bytes before a Posted's entries, and per entry.
const POSTED_HEAD: usize = 8;
const POSTED_ENTRY: usize = 8;
/// The largest eager limit an Ack states (the word's top bit is its
/// `announce` flag).
const ACK_EAGER_MAX: u32 = (1 << 31) - 1;

/// Where the address of a Conn or Ack starts.
const ADDR_AT: usize = 28;

/// An [`Ctrl::Eager`] read in place, `(tag, idx, data)`: what a receive
/// comm copies into NCCL's buffer straight from the hub's (None: `buf` is
/// no well-formed eager message).
pub fn eager(buf: &[u8]) -> Option<(i32, u32, &[u8])> {
    let head = buf.get(..EAGER_HEAD)?;
    let ok = head[6] == KIND_EAGER
        && head[..4] == CTRL_MAGIC.to_le_bytes()
        && head[4..6] == HANDLE_VERSION.to_le_bytes();
    let u32_at = |i: usize| u32::from_le_bytes(head[i..i + 4].try_into().expect("4 bytes"));
    ok.then(|| (u32_at(8) as i32, u32_at(12), &buf[EAGER_HEAD..]))
}

/// Whether `buf` (a received control message) is a [`Ctrl::Want`]: read
/// without decoding, by whoever queues messages.
pub fn is_want(buf: &[u8]) -> bool {
    buf.len() >= 16 && buf[6] == KIND_WANT && buf[..4] == CTRL_MAGIC.to_le_bytes()
}

/// Whether `buf` (a received control message) is an [`Ctrl::Alive`]: read
/// without decoding, by whoever queues messages.
pub fn is_alive(buf: &[u8]) -> bool {
    buf.len() >= 12 && buf[6] == KIND_ALIVE && buf[..4] == CTRL_MAGIC.to_le_bytes()
}

/// How many entries of `size` bytes after `head` a message with a count in
/// byte 7 has: 1 ..= [`super::MAX_RECVS`] (else `bad(count)`), all present.
fn entries(
    buf: &[u8],
    head: usize,
    size: usize,
    bad: fn(usize) -> CtrlError,
) -> Result<usize, CtrlError> {
    let n = usize::from(buf[7]);
    if n == 0 || n > super::MAX_RECVS {
        return Err(bad(n));
    }
    if buf.len() < head + n * size {
        return Err(CtrlError::Truncated(buf.len()));
    }
    Ok(n)
}

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
                id,
                addr,
            } => {
                out[6] = KIND_CONN;
                out[8..16].copy_from_slice(&listener.to_le_bytes());
                out[16..24].copy_from_slice(&conn.to_le_bytes());
                out[24..28].copy_from_slice(&id.to_le_bytes());
                put_addr(out, ADDR_AT, addr)
            }
            Ctrl::Ack {
                conn,
                credits,
                eager,
                announce,
                id,
                addr,
            } => {
                out[6] = KIND_ACK;
                out[8..16].copy_from_slice(&conn.to_le_bytes());
                out[16..20].copy_from_slice(&credits.to_le_bytes());
                let word = (*eager).min(ACK_EAGER_MAX) | (u32::from(*announce) << 31);
                out[20..24].copy_from_slice(&word.to_le_bytes());
                out[24..28].copy_from_slice(&id.to_le_bytes());
                put_addr(out, ADDR_AT, addr)
            }
            Ctrl::Rtr {
                seq,
                slot,
                credits,
                subs,
                bufs,
            } => {
                let n = bufs.len().min(super::MAX_RECVS);
                out[6] = KIND_RTR;
                out[7] = n as u8;
                out[8..12].copy_from_slice(&seq.to_le_bytes());
                out[12] = *slot;
                out[13] = *subs;
                out[14..16].copy_from_slice(&credits.to_le_bytes());
                for (i, b) in bufs[..n].iter().enumerate() {
                    let at = RTR_HEAD + i * RTR_BUF;
                    out[at..at + 4].copy_from_slice(&b.tag.to_le_bytes());
                    out[at + 4..at + 12].copy_from_slice(&b.size.to_le_bytes());
                    out[at + 12..at + 20].copy_from_slice(&b.addr.to_le_bytes());
                    out[at + 20..at + 28].copy_from_slice(&b.key.to_le_bytes());
                    out[at + 28..at + 32].copy_from_slice(&b.idx.to_le_bytes());
                    out[at + 32..at + 36].copy_from_slice(&b.ticket.to_le_bytes());
                }
                RTR_HEAD + n * RTR_BUF
            }
            Ctrl::Wrote { slot, sub, size } | Ctrl::Trunc { slot, sub, size } => {
                out[6] = if matches!(self, Ctrl::Wrote { .. }) {
                    KIND_WROTE
                } else {
                    KIND_TRUNC
                };
                out[7] = 0;
                out[8] = *slot;
                out[9] = *sub;
                out[10..16].fill(0);
                out[16..24].copy_from_slice(&size.to_le_bytes());
                24
            }
            Ctrl::Failed { slot, sub, err } => {
                out[6] = KIND_FAILED;
                out[7] = 0;
                out[8] = *slot;
                out[9] = *sub;
                out[10..12].fill(0);
                out[12..16].copy_from_slice(&err.to_le_bytes());
                16
            }
            Ctrl::Want { tag, idx, large } => {
                out[6] = KIND_WANT;
                out[7] = u8::from(*large);
                out[8..12].copy_from_slice(&tag.to_le_bytes());
                out[12..16].copy_from_slice(&idx.to_le_bytes());
                16
            }
            Ctrl::Credit { count } => {
                out[6] = KIND_CREDIT;
                out[7] = 0;
                out[8..12].copy_from_slice(&count.to_le_bytes());
                12
            }
            Ctrl::Eager { tag, idx, data } => {
                // Only what fits a control buffer; real eager messages go
                // through `encode_eager`.
                let mut v = Vec::new();
                let n = data.len().min(CTRL_MAX - EAGER_HEAD);
                Ctrl::encode_eager(*tag, *idx, &data[..n], &mut v);
                out[..v.len()].copy_from_slice(&v);
                v.len()
            }
            Ctrl::Alive => {
                out[6] = KIND_ALIVE;
                out[7] = 0;
                out[8..12].fill(0);
                12
            }
            Ctrl::Posted { counts } => {
                let n = counts.len().min(super::MAX_RECVS);
                out[6] = KIND_POSTED;
                out[7] = n as u8;
                for (i, (tag, count)) in counts[..n].iter().enumerate() {
                    let at = POSTED_HEAD + i * POSTED_ENTRY;
                    out[at..at + 4].copy_from_slice(&tag.to_le_bytes());
                    out[at + 4..at + 8].copy_from_slice(&count.to_le_bytes());
                }
                POSTED_HEAD + n * POSTED_ENTRY
            }
            Ctrl::Bye { sent } => {
                out[6] = KIND_BYE;
                out[7] = 0;
                out[8..12].copy_from_slice(&sent.to_le_bytes());
                12
            }
        }
    }

    /// Appends an [`Ctrl::Eager`] of `data` to `out` (any length; control
    /// messages of fixed size use [`Ctrl::encode`]).
    pub fn encode_eager(tag: i32, idx: u32, data: &[u8], out: &mut Vec<u8>) {
        out.extend_from_slice(&Self::eager_head(tag, idx));
        out.extend_from_slice(data);
    }

    /// The bytes of an [`Ctrl::Eager`] before its data.
    pub fn eager_head(tag: i32, idx: u32) -> [u8; EAGER_HEAD] {
        let mut h = [0u8; EAGER_HEAD];
        h[..4].copy_from_slice(&CTRL_MAGIC.to_le_bytes());
        h[4..6].copy_from_slice(&HANDLE_VERSION.to_le_bytes());
        h[6] = KIND_EAGER;
        h[8..12].copy_from_slice(&tag.to_le_bytes());
        h[12..16].copy_from_slice(&idx.to_le_bytes());
        h
    }

    /// Decodes and validates `buf` (exactly the received bytes). An eager
    /// message's bytes are copied; [`eager`] reads one in place.
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
            buf.get(ADDR_AT..ADDR_AT + n)
                .map(<[u8]>::to_vec)
                .ok_or(CtrlError::Truncated(buf.len()))
        };
        let u32_at = |i: usize| u32::from_le_bytes(buf[i..i + 4].try_into().expect("4 bytes"));
        match buf[6] {
            KIND_CONN if buf.len() >= ADDR_AT => Ok(Ctrl::Conn {
                listener: u64_at(8),
                conn: u64_at(16),
                id: u32_at(24),
                addr: addr()?,
            }),
            KIND_ACK if buf.len() >= ADDR_AT => Ok(Ctrl::Ack {
                conn: u64_at(8),
                credits: u32_at(16),
                eager: u32_at(20) & ACK_EAGER_MAX,
                announce: u32_at(20) >> 31 != 0,
                id: u32_at(24),
                addr: addr()?,
            }),
            KIND_RTR => {
                let n = entries(buf, RTR_HEAD, RTR_BUF, CtrlError::RtrCount)?;
                let bufs = (0..n)
                    .map(|i| {
                        let at = RTR_HEAD + i * RTR_BUF;
                        RtrBuf {
                            tag: u32_at(at) as i32,
                            size: u64_at(at + 4),
                            addr: u64_at(at + 12),
                            key: u64_at(at + 20),
                            idx: u32_at(at + 28),
                            ticket: u32_at(at + 32),
                        }
                    })
                    .collect(); // n <= MAX_RECVS (`entries`)
                let subs = buf[13];
                if subs.count_ones() as usize != n {
                    return Err(CtrlError::RtrSubs(subs, n));
                }
                Ok(Ctrl::Rtr {
                    seq: u32_at(8),
                    slot: buf[12],
                    credits: u16::from_le_bytes([buf[14], buf[15]]),
                    subs,
                    bufs,
                })
            }
            KIND_WROTE | KIND_TRUNC if buf.len() >= 24 => {
                let (slot, sub, size) = (buf[8], buf[9], u64_at(16));
                Ok(if buf[6] == KIND_WROTE {
                    Ctrl::Wrote { slot, sub, size }
                } else {
                    Ctrl::Trunc { slot, sub, size }
                })
            }
            KIND_FAILED if buf.len() >= 16 => Ok(Ctrl::Failed {
                slot: buf[8],
                sub: buf[9],
                err: u32_at(12),
            }),
            KIND_CREDIT => Ok(Ctrl::Credit {
                count: u32::from_le_bytes(buf[8..12].try_into().expect("4 bytes")),
            }),
            KIND_ALIVE => Ok(Ctrl::Alive),
            KIND_WANT if buf.len() >= 16 => Ok(Ctrl::Want {
                tag: u32_at(8) as i32,
                idx: u32_at(12),
                large: buf[7] & 1 != 0,
            }),
            KIND_EAGER if buf.len() >= EAGER_HEAD => {
                let (tag, idx, data) = eager(buf).expect("an eager message's header");
                Ok(Ctrl::Eager {
                    tag,
                    idx,
                    data: data.to_vec(),
                })
            }
            KIND_BYE => Ok(Ctrl::Bye { sent: u32_at(8) }),
            KIND_POSTED => {
                let n = entries(buf, POSTED_HEAD, POSTED_ENTRY, CtrlError::PostedCount)?;
                let counts = (0..n)
                    .map(|i| {
                        let at = POSTED_HEAD + i * POSTED_ENTRY;
                        (u32_at(at) as i32, u32_at(at + 4))
                    })
                    .collect();
                Ok(Ctrl::Posted { counts })
            }
            KIND_CONN | KIND_ACK | KIND_WROTE | KIND_TRUNC | KIND_EAGER | KIND_FAILED
            | KIND_WANT => {
                Err(CtrlError::Truncated(buf.len()))
            }
            k => Err(CtrlError::Kind(k)),
        }
    }
}

// ---- The bits Weft packs into what libfabric carries for it ----

/// Comm ids are below this (24 bits: they ride in a 32-bit immediate).
pub const MAX_ID: u32 = 1 << 24;

/// The context of an operation posted by comm `id`: its id and 32 bits of
/// its own.
pub fn context(id: u32, local: u32) -> *mut std::ffi::c_void {
    ((u64::from(id) << 32) | u64::from(local)) as usize as *mut std::ffi::c_void
}

/// The tag of a data message to comm `id` at the peer with NCCL's `tag`.
pub fn data_tag(id: u32, tag: i32) -> u64 {
    (u64::from(id & (MAX_ID - 1)) << 32) | u64::from(tag as u32)
}

/// The immediate of a write to comm `id` at the peer, with 8 bits of its
/// own: 32 bits. Where the hub has wide immediates, the upper 32 bits are
/// the size (or [`NO_SIZE`]: it comes in a control message) XOR the
/// offer's `ticket` ([`RtrBuf::ticket`]).
pub fn immediate(id: u32, local: u8, size: Option<u64>, ticket: u32) -> u64 {
    let size = size
        .filter(|&s| s < u64::from(NO_SIZE))
        .map_or(NO_SIZE, |s| s as u32);
    (u64::from(size ^ ticket) << 32) | u64::from((id << 8) | u32::from(local))
}

/// What the upper 32 bits of a wide immediate say, given the offer's
/// `ticket`: `Some(size)`, or `None` when the size comes in a control
/// message.
pub fn immediate_size(hi: u32, ticket: u32) -> Option<u64> {
    let v = hi ^ ticket;
    (v != NO_SIZE).then_some(u64::from(v))
}

/// Upper immediate bits meaning "the size comes in a control message".
pub const NO_SIZE: u32 = u32::MAX;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn handle() -> [u8; HANDLE_SIZE] {
        let mut h = [0u8; HANDLE_SIZE];
        ListenHandle {
            nonce: 0x1122_3344_5566_7788,
            addr: vec![2, 0, 0x1f, 0x90, 127, 0, 0, 1],
            id: 0xabcd,
            proto: PROTO_RDMA,
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
        assert_eq!((d.id, d.proto), (0xabcd, PROTO_RDMA));
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
        let mut v1 = handle();
        v1[4] = 1;
        assert_eq!(ListenHandle::decode(&v1), Err(HandleError::Version(1)));
        let mut id = handle();
        id[ID_OFFSET] ^= 1;
        assert!(
            matches!(ListenHandle::decode(&id), Err(HandleError::Check { .. })),
            "the comm id is covered by the check"
        );
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
            id: 0,
            proto: PROTO_SENDRECV,
        }
        .encode(&mut h)
        .unwrap();
        assert_eq!(ListenHandle::decode(&h), Err(HandleError::AddrLen(0)));
        for msg in [
            Ctrl::Conn {
                listener: 1,
                conn: 2,
                id: 0,
                addr: Vec::new(),
            },
            Ctrl::Ack {
                conn: 2,
                credits: 3,
                eager: 0,
                announce: false,
                id: 0,
                addr: Vec::new(),
            },
        ] {
            let mut b = [0u8; CTRL_MAX];
            let n = msg.encode(&mut b);
            assert_eq!(Ctrl::decode(&b[..n]), Err(CtrlError::AddrLen(0)));
        }
    }

    fn rails(n: usize, addr_len: usize) -> Vec<ListenHandle> {
        (0..n)
            .map(|i| ListenHandle {
                nonce: (u64::MAX - 1).wrapping_add(i as u64),
                addr: vec![i as u8 + 1; addr_len],
                id: 100 + i as u32,
                proto: PROTO_RDMA,
            })
            .collect()
    }

    #[test]
    fn rails_handles_round_trip_and_say_they_are_rails() {
        let mut h = [0u8; HANDLE_SIZE];
        for n in 1..=4 {
            let r = rails(n, 16);
            encode_rails(&r, &mut h).unwrap();
            assert_eq!(decode_any(&h).unwrap(), (r, true), "{n} rails");
            // The stage area stays free for connect.
            assert_eq!(read_stage(&h), Ok(None));
            assert!(matches!(
                ListenHandle::decode(&h),
                Err(HandleError::Rails(_))
            ));
        }
        rails(1, 16)[0].encode(&mut h).unwrap();
        assert_eq!(decode_any(&h).unwrap(), (rails(1, 16), false));
    }

    #[test]
    fn rails_that_do_not_fit_or_belong_are_refused() {
        let mut h = [0u8; HANDLE_SIZE];
        assert_eq!(
            encode_rails(&rails(5, 16), &mut h),
            Err(HandleError::RailsTooLong(105))
        );
        assert!(encode_rails(&[], &mut h).is_err());
        let mut r = rails(2, 16);
        r[1].nonce = 7;
        assert!(matches!(
            encode_rails(&r, &mut h),
            Err(HandleError::Rails(_))
        ));
        let mut r = rails(2, 16);
        r[1].proto = PROTO_SENDRECV;
        assert!(matches!(
            encode_rails(&r, &mut h),
            Err(HandleError::Rails(_))
        ));
    }

    #[test]
    fn corrupted_rails_handles_are_refused() {
        let mut good = [0u8; HANDLE_SIZE];
        encode_rails(&rails(3, 16), &mut good).unwrap();
        for at in 0..STAGE_OFFSET {
            let mut h = good;
            h[at] ^= 0x5a;
            assert!(
                decode_any(&h).is_err(),
                "a flipped byte {at} went unnoticed"
            );
        }
        let mut h = good;
        h[6] = 9;
        assert!(matches!(decode_any(&h), Err(HandleError::Rails(_))));
        let mut h = good;
        h[20] = 90; // rail 0's address would run past the area
        assert!(matches!(decode_any(&h), Err(HandleError::Rails(_))));
    }

    #[test]
    fn ctrl_round_trips() {
        let mut b = [0u8; CTRL_MAX];
        for m in [
            Ctrl::Conn {
                listener: 1,
                conn: 2,
                id: 77,
                addr: vec![9; 16],
            },
            Ctrl::Ack {
                conn: 2,
                credits: 256,
                eager: 8192,
                announce: false,
                id: 78,
                addr: vec![7; 40],
            },
            Ctrl::Ack {
                conn: 3,
                credits: 16,
                eager: 8192,
                announce: true,
                id: 79,
                addr: vec![6; 40],
            },
            Ctrl::Credit { count: 64 },
            Ctrl::Alive,
            Ctrl::Bye { sent: 0x0102_0304 },
            Ctrl::Failed {
                slot: 9,
                sub: 2,
                err: 265,
            },
            Ctrl::Rtr {
                seq: 7,
                slot: 31,
                credits: 0xbeef,
                subs: 0xff,
                bufs: (0..super::super::MAX_RECVS as u64)
                    .map(|i| RtrBuf {
                        tag: -(i as i32),
                        size: 1 << (i * 4),
                        addr: 0x7f00_0000_0000 + i,
                        key: u64::MAX - i,
                        idx: i as u32 * 3,
                        ticket: 0xdead_0000 + i as u32,
                    })
                    .collect(),
            },
            Ctrl::Rtr {
                seq: 8,
                slot: 2,
                credits: 0,
                subs: 0b1010,
                bufs: [1, 3]
                    .into_iter()
                    .map(|i| RtrBuf {
                        tag: 4,
                        size: 64,
                        addr: 0x1000 * i,
                        key: 5,
                        idx: i as u32,
                        ticket: 6,
                    })
                    .collect(),
            },
            Ctrl::Want {
                tag: -3,
                idx: 77,
                large: true,
            },
            Ctrl::Want {
                tag: 5,
                idx: 0,
                large: false,
            },
            Ctrl::Wrote {
                slot: 3,
                sub: 7,
                size: 1 << 40,
            },
            Ctrl::Eager {
                tag: -5,
                idx: 9,
                data: vec![1, 2, 3],
            },
            Ctrl::Eager {
                tag: 5,
                idx: 0,
                data: Vec::new(),
            },
            Ctrl::Trunc {
                slot: 4,
                sub: 0,
                size: 9,
            },
            Ctrl::Posted {
                counts: [(-1, u32::MAX)].into_iter().collect(),
            },
            Ctrl::Posted {
                counts: (0..super::super::MAX_RECVS as u32)
                    .map(|i| (i as i32 * 7, i.wrapping_mul(0x0101_0101)))
                    .collect(),
            },
        ] {
            let n = m.encode(&mut b);
            assert_eq!(Ctrl::decode(&b[..n]).unwrap(), m);
        }
    }

    /// An Rtr's buffer mask names exactly its entries.
    #[test]
    fn rtr_masks_name_their_entries() {
        let mut b = [0u8; CTRL_MAX];
        let n = Ctrl::Rtr {
            seq: 1,
            slot: 0,
            credits: 0,
            subs: 0b100,
            bufs: [RtrBuf {
                tag: 1,
                size: 8,
                addr: 0,
                key: 0,
                idx: 0,
                ticket: 0,
            }]
            .into_iter()
            .collect(),
        }
        .encode(&mut b);
        assert!(Ctrl::decode(&b[..n]).is_ok());
        for subs in [0, 0b110, 0xff] {
            b[13] = subs;
            assert_eq!(Ctrl::decode(&b[..n]), Err(CtrlError::RtrSubs(subs, 1)));
        }
        let n = Ctrl::Want {
            tag: 1,
            idx: 2,
            large: true,
        }
        .encode(&mut b);
        assert_eq!(Ctrl::decode(&b[..n - 1]), Err(CtrlError::Truncated(15)));
    }

    #[test]
    fn posted_names_one_to_eight_tags_and_all_of_them() {
        let mut b = [0u8; CTRL_MAX];
        let n = Ctrl::Posted {
            counts: [(1, 2), (3, 4)].into_iter().collect(),
        }
        .encode(&mut b);
        assert_eq!(n, 24);
        assert_eq!(Ctrl::decode(&b[..n - 1]), Err(CtrlError::Truncated(23)));
        b[7] = 0;
        assert_eq!(Ctrl::decode(&b[..n]), Err(CtrlError::PostedCount(0)));
        b[7] = 9;
        assert_eq!(Ctrl::decode(&b[..n]), Err(CtrlError::PostedCount(9)));
    }

    proptest! {
        /// Any bytes: decoding never panics, and truncating a valid message
        /// never yields a different valid one.
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..CTRL_MAX)) {
            let _ = Ctrl::decode(&bytes);
            let mut h = [0u8; HANDLE_SIZE];
            let n = bytes.len().min(HANDLE_SIZE);
            h[..n].copy_from_slice(&bytes[..n]);
            let _ = ListenHandle::decode(&h);
            let _ = read_stage(&h);
            let _ = decode_any(&h);
            // And as a rails handle, whose rail list is what is random.
            h[0..4].copy_from_slice(&HANDLE_MAGIC);
            h[4..6].copy_from_slice(&HANDLE_VERSION.to_le_bytes());
            h[7] |= PROTO_RAILS;
            let _ = decode_any(&h);
        }

        #[test]
        fn truncated_conn_is_refused(cut in 0usize..44) {
            let mut b = [0u8; CTRL_MAX];
            let n = Ctrl::Conn { listener: 5, conn: 6, id: 1, addr: vec![1; 16] }.encode(&mut b);
            prop_assume!(cut < n);
            prop_assert!(Ctrl::decode(&b[..cut]).is_err());
        }
    }
}
