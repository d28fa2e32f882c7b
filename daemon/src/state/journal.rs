//! The allocation store's journal format (`<state_dir>/allocations.journal`, see
//! [`super::store`]): frame encoding and decoding, the replay scan, and the zero fill.
//!
//! # Format
//!
//! The file is a run of frames, back to back from offset 0, followed by zeros up to the file's
//! size (its capacity: the zeros are really written when the file is made, so writing a frame in
//! place never changes the file's size or its block map). A frame is:
//!
//! | bytes | what |
//! | --- | --- |
//! | 0..4 | [`MAGIC`], u32 little-endian: the bytes `F7 'T' 'J' '1'` (`0xF7` never occurs in UTF-8, so never in a payload) |
//! | 4..8 | the payload's length, u32 little-endian, 1..=[`MAX_PAYLOAD`] |
//! | 8..12 | the CRC-32 (IEEE) of the payload, u32 little-endian |
//! | 12.. | the payload: compact JSON, `{"header": {"records": N, "bytes": B}}`, `{"put": <Allocation>}` or `{"remove": "<id>"}` |
//!
//! The first frame is the header the compaction writes (only there): the snapshot after it holds
//! `records` put frames in `bytes` bytes. (Journals written before headers start with a put; they
//! are read, then compacted.) A put adds or replaces the record with its id; a remove drops the
//! record (a remove of an id not held is a no-op). Replaying the frames in order gives the
//! store's records.
//!
//! # Reading
//!
//! [`scan_file`] reads frames from offset 0, a window of 1 MiB (or one frame) at a time, skipping
//! holes (`SEEK_DATA`): a huge sparse file costs neither memory nor a read of its holes.
//! Where no valid frame starts:
//!
//! - all zeros to the end of the file: the clean end;
//! - else, if a whole valid frame starts later in the file, the bytes in between are **damage**
//!   (something other than our writes changed the file): it is reported and the scan resumes at
//!   that frame, so the changes after the damage are kept;
//! - else it is the last frame, and if it could be a single write cut short by a crash (each of
//!   its header's magic bytes either the magic's or zero, a length within [`MAX_PAYLOAD`], a frame
//!   running past the end of the file, or a failing checksum with only zeros after the frame's
//!   end) it is a **torn** write: the store appends one frame at a time and flushes it before it
//!   acknowledges the change, so a torn frame was never acknowledged and is dropped without a
//!   report. (The one exception, a kubelet `Allocate`'s new record, is acknowledged before its
//!   flush: a power cut can tear it, or leave a zeroed stretch before a later frame that reached
//!   the disk, reported as damage. Its record is then made again from the kubelet's checkpoint,
//!   `crate::allocator::kubelet_grants`.) Anything else (a foreign magic, an impossible length, bytes after the frame's end, or
//!   a frame whose checksum holds but whose payload is not a valid change) is damage.
//!
//! Lost data is damage too: frames that end inside the header's snapshot (fsynced whole before
//! it became the journal, so never torn), and, found by [`file_damage`], an empty journal, a
//! size the store never makes (cut short), or a journal of zeros with no header.
//!
//! A valid frame: the magic, a length in range whose frame fits in the file, the checksum of the
//! payload, and a payload that decodes to a change whose id passes
//! [`valid_id`](super::record::valid_id) (or the header, at offset 0).

use std::fs::File;
use std::os::unix::fs::FileExt;

use serde::{Deserialize, Serialize};

use super::record::{Allocation, valid_id};

/// The journal's file name in the store's directory.
pub const FILE_NAME: &str = "allocations.journal";
/// The compaction's temporary file, renamed over [`FILE_NAME`] when whole.
pub const TMP_NAME: &str = "allocations.journal.tmp";
/// The prefix of a damaged journal's copy: `allocations.journal.corrupt-<unix-ns>`.
pub const CORRUPT_PREFIX: &str = "allocations.journal.corrupt-";

const MAGIC_BYTES: [u8; 4] = [0xF7, b'T', b'J', b'1'];
/// The first field of every frame.
pub const MAGIC: u32 = u32::from_le_bytes(MAGIC_BYTES);
/// Magic, length, checksum.
pub const HEADER_LEN: usize = 12;
/// The longest payload a frame may carry (a record is a few hundred bytes).
pub const MAX_PAYLOAD: usize = 16 << 20;
/// The smallest journal file.
pub const MIN_CAPACITY: u64 = 1 << 20;
/// Capacities are multiples of this.
pub const CAPACITY_STEP: u64 = 64 << 10;

/// The first frame of every journal the store writes (its compaction): how many records the
/// snapshot after it holds and how many bytes their frames take. A journal that ends before the
/// snapshot does, or that has no header, lost data (see [`file_damage`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Header {
    /// Put frames in the snapshot.
    pub records: u64,
    /// Bytes of those frames, from the end of the header frame.
    pub bytes: u64,
}

/// A change, as written (borrowed).
#[derive(Debug, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OpRef<'a> {
    Header(Header),
    Put(&'a Allocation),
    Remove(&'a str),
}

/// A change, as read back.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    Header(Header),
    Put(Allocation),
    Remove(String),
}

/// The frame of one change; `Err` says why it cannot be encoded.
pub fn encode(op: &OpRef<'_>) -> Result<Vec<u8>, String> {
    let payload = serde_json::to_vec(op).map_err(|e| e.to_string())?;
    if payload.len() > MAX_PAYLOAD {
        return Err(format!("the change is {} bytes, more than a journal frame holds ({MAX_PAYLOAD})", payload.len()));
    }
    Ok(frame(&payload))
}

/// The frame of a payload (any bytes; [`encode`] makes the payload of a change).
pub fn frame(payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).expect("a payload is at most MAX_PAYLOAD bytes");
    let mut frame = Vec::with_capacity(HEADER_LEN + payload.len());
    frame.extend_from_slice(&MAGIC.to_le_bytes());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// The journal size for `bytes` of live frames: max(1 MiB, 4 × `bytes`), rounded up to 64 KiB.
pub fn capacity_for(bytes: u64) -> u64 {
    MIN_CAPACITY.max(bytes.saturating_mul(4)).div_ceil(CAPACITY_STEP).saturating_mul(CAPACITY_STEP)
}

/// Whether the store could have made a journal of `len` bytes (a capacity: see [`capacity_for`]).
pub fn is_capacity(len: u64) -> bool {
    len >= MIN_CAPACITY && len.is_multiple_of(CAPACITY_STEP)
}

/// Writes zeros into `file` over `from..to` (really written, not a hole).
pub fn zero_fill(file: &File, from: u64, to: u64) -> std::io::Result<()> {
    let zeros = vec![0u8; CAPACITY_STEP as usize];
    let mut at = from;
    while at < to {
        let n = (to - at).min(CAPACITY_STEP) as usize;
        file.write_all_at(&zeros[..n], at)?;
        at += n as u64;
    }
    Ok(())
}

/// A stretch of the journal that is neither frames nor the zero tail, or data the journal lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damage {
    /// Where the first frame that did not check out starts (or where the loss begins).
    pub offset: u64,
    /// What was wrong with it.
    pub reason: String,
    /// The next whole frame, where the replay went on; `None`: nothing after it could be read.
    pub resumed_at: Option<u64>,
}

impl std::fmt::Display for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "offset {}: {}; ", self.offset, self.reason)?;
        match self.resumed_at {
            Some(at) => write!(f, "replay resumed at the next whole frame, offset {at}"),
            None => write!(f, "no whole frame after it"),
        }
    }
}

/// What [`scan`] read.
#[derive(Debug, Default)]
pub struct Replay {
    /// The changes, in order (the header is not one: see [`Replay::header`]).
    pub ops: Vec<Op>,
    /// The header frame at offset 0; `None` for a journal written before headers (or damaged).
    pub header: Option<Header>,
    /// Where the last valid frame ends.
    pub end: u64,
    /// The offset of a torn final write that was dropped.
    pub torn: Option<u64>,
    /// Damaged stretches, in order.
    pub damage: Vec<Damage>,
    /// The bytes scanned (the file's size).
    pub len: u64,
}

impl Replay {
    /// The number of records the replay's changes leave.
    pub fn puts(&self) -> usize {
        self.ops.iter().filter(|op| matches!(op, Op::Put(_))).count()
    }
}

/// Damage only the file as a whole shows, which the store never leaves behind: an empty journal,
/// a size it never makes (cut short), or a journal with no frame at all (zeroed). `None` when
/// none of these. (A snapshot that ends early is found by [`scan`].)
pub fn file_damage(replay: &Replay) -> Option<Damage> {
    let reason = if replay.len == 0 {
        "the journal is empty (0 bytes): truncated or replaced".to_string()
    } else if !is_capacity(replay.len) {
        format!(
            "the journal is {} bytes, a size the store never makes (a multiple of {CAPACITY_STEP}, at least \
             {MIN_CAPACITY}): truncated",
            replay.len
        )
    } else if replay.header.is_none() && replay.ops.is_empty() && replay.damage.is_empty() && replay.torn.is_none() {
        format!("the journal is all zeros ({} bytes) with no header frame: zero-filled", replay.len)
    } else {
        return None;
    };
    Some(Damage { offset: replay.end, reason, resumed_at: None })
}

/// How much of the journal a [`Reader`] holds in memory at once (beyond one frame).
const WINDOW: usize = 1 << 20;

/// The journal's bytes, read a window at a time (a journal is never read whole: a damaged one
/// may be huge and sparse). Holes are skipped without reading them.
struct Reader<'a> {
    src: Src<'a>,
    len: u64,
    buf: Vec<u8>,
    buf_at: u64,
}

enum Src<'a> {
    Bytes(&'a [u8]),
    File(&'a File),
}

impl Reader<'_> {
    /// Up to `n` bytes at `at` (fewer at the end of the file).
    fn bytes(&mut self, at: u64, n: usize) -> std::io::Result<&[u8]> {
        let n = usize::try_from((self.len.saturating_sub(at)).min(n as u64)).unwrap_or(n);
        let file = match self.src {
            Src::Bytes(b) => return Ok(&b[at as usize..at as usize + n]),
            Src::File(f) => f,
        };
        let cached = at >= self.buf_at && at + n as u64 <= self.buf_at + self.buf.len() as u64;
        if !cached {
            let want = usize::try_from((self.len - at).min(n.max(WINDOW) as u64)).unwrap_or(WINDOW);
            self.buf.resize(want, 0);
            file.read_exact_at(&mut self.buf, at)?;
            self.buf_at = at;
        }
        let from = (at - self.buf_at) as usize;
        Ok(&self.buf[from..from + n])
    }

    /// The first offset at or after `at` that may hold data; `None`: only holes (zeros) from there.
    fn data_from(&self, at: u64) -> std::io::Result<Option<u64>> {
        if at >= self.len {
            return Ok(None);
        }
        let Src::File(file) = self.src else { return Ok(Some(at)) };
        let Ok(offset) = libc::off_t::try_from(at) else { return Ok(Some(at)) };
        // SAFETY: lseek on a descriptor the `File` keeps open; it reads no memory of ours.
        let found = unsafe { libc::lseek(std::os::fd::AsRawFd::as_raw_fd(file), offset, libc::SEEK_DATA) };
        if found >= 0 {
            return Ok(Some(found as u64).filter(|&d| d < self.len));
        }
        match std::io::Error::last_os_error() {
            e if e.raw_os_error() == Some(libc::ENXIO) => Ok(None),
            // A file system without SEEK_DATA: everything may be data.
            e if e.raw_os_error() == Some(libc::EINVAL) => Ok(Some(at)),
            e => Err(e),
        }
    }

    /// Whether everything from `at` to the end is zero.
    fn all_zero_from(&mut self, mut at: u64) -> std::io::Result<bool> {
        while let Some(data) = self.data_from(at)? {
            let chunk = self.bytes(data, WINDOW)?;
            if chunk.iter().any(|&b| b != 0) {
                return Ok(false);
            }
            at = data + chunk.len() as u64;
        }
        Ok(true)
    }
}

/// Why no valid frame starts at an offset.
enum Bad {
    /// The header is not ours, or is cut off by the end of the file.
    Header(String),
    /// Our magic with a length that no frame has.
    Length(String),
    /// Our magic, a length in range, and a frame that runs past the end of the file.
    PastEnd(String),
    /// A whole frame whose checksum fails; `end` is where the frame ends.
    Checksum { end: u64, reason: String },
    /// A whole frame, checksum right, whose payload is not a valid change.
    Content(String),
}

impl Bad {
    fn reason(&self) -> &str {
        match self {
            Bad::Header(r) | Bad::Length(r) | Bad::PastEnd(r) | Bad::Content(r) => r,
            Bad::Checksum { reason, .. } => reason,
        }
    }
}

fn u32_at(buf: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]])
}

/// The change in the frame at `at`, and the frame's length.
fn decode_at(r: &mut Reader<'_>, at: u64) -> std::io::Result<Result<(Op, u64), Bad>> {
    let head = r.bytes(at, HEADER_LEN)?;
    if head.len() < HEADER_LEN {
        return Ok(Err(Bad::Header(format!("a frame header cut off by the end of the file ({} bytes)", head.len()))));
    }
    let magic = u32_at(head, 0);
    if magic != MAGIC {
        return Ok(Err(Bad::Header(format!("no frame header (magic {magic:#010x}, not {MAGIC:#010x})"))));
    }
    let (len, want) = (u32_at(head, 4) as usize, u32_at(head, 8));
    if len == 0 || len > MAX_PAYLOAD {
        return Ok(Err(Bad::Length(format!("a frame length of {len} bytes (1..={MAX_PAYLOAD})"))));
    }
    let end = (HEADER_LEN + len) as u64;
    if at + end > r.len {
        return Ok(Err(Bad::PastEnd(format!("a {len}-byte frame that runs past the end of the file"))));
    }
    let payload = &r.bytes(at, HEADER_LEN + len)?[HEADER_LEN..];
    let got = crc32fast::hash(payload);
    if want != got {
        return Ok(Err(Bad::Checksum {
            end: at + end,
            reason: format!("a {len}-byte frame whose checksum fails (crc32 {got:#010x}, header says {want:#010x})"),
        }));
    }
    let op: Op = match serde_json::from_slice(payload) {
        Ok(op) => op,
        Err(e) => return Ok(Err(Bad::Content(format!("a checksummed frame that is not a change: {e}")))),
    };
    let id = match &op {
        Op::Put(a) => &a.id,
        Op::Remove(id) => id,
        Op::Header(_) if at == 0 => return Ok(Ok((op, end))),
        Op::Header(_) => return Ok(Err(Bad::Content("a header frame after the start of the journal".to_string()))),
    };
    if let Err(e) = valid_id(id) {
        return Ok(Err(Bad::Content(format!("a checksummed frame with an invalid record: {e}"))));
    }
    Ok(Ok((op, end)))
}

/// The next offset at or after `from` where a valid frame starts (holes skipped).
fn next_frame(r: &mut Reader<'_>, from: u64) -> std::io::Result<Option<u64>> {
    let mut at = from;
    while let Some(data) = r.data_from(at)? {
        at = data;
        let chunk = r.bytes(at, WINDOW)?;
        let chunk_len = chunk.len() as u64;
        let Some(skip) = chunk.iter().position(|&b| b == MAGIC_BYTES[0]) else {
            at += chunk_len;
            continue;
        };
        at += skip as u64;
        if r.len - at >= HEADER_LEN as u64 && decode_at(r, at)?.is_ok() {
            return Ok(Some(at));
        }
        at += 1;
    }
    Ok(None)
}

/// Whether the bytes from `at` (the last thing in the file that is not zero, with no valid frame
/// after it) can be one frame write cut short.
fn torn(r: &mut Reader<'_>, at: u64, bad: &Bad) -> std::io::Result<bool> {
    Ok(match bad {
        // Each magic byte either written or not: any other value is not ours.
        Bad::Header(_) => r.bytes(at, 4)?.iter().zip(MAGIC_BYTES).all(|(&b, m)| b == 0 || b == m),
        // A length field partly written reads short, never past the limit; zero is unwritten.
        Bad::Length(_) => u32_at(r.bytes(at, HEADER_LEN)?, 4) == 0,
        Bad::PastEnd(_) => true,
        Bad::Checksum { end, .. } => r.all_zero_from(*end)?,
        Bad::Content(_) => false,
    })
}

/// Reads the frames of a journal held in memory (see the module doc).
pub fn scan(buf: &[u8]) -> Replay {
    let mut r = Reader { src: Src::Bytes(buf), len: buf.len() as u64, buf: Vec::new(), buf_at: 0 };
    scan_reader(&mut r).expect("reading bytes in memory cannot fail")
}

/// Reads the frames of the journal `file`, a window at a time, holes skipped: memory stays
/// bounded (about 1 MiB and one frame) whatever the file's size.
pub fn scan_file(file: &File) -> std::io::Result<Replay> {
    let len = file.metadata()?.len();
    let mut r = Reader { src: Src::File(file), len, buf: Vec::new(), buf_at: 0 };
    scan_reader(&mut r)
}

fn scan_reader(r: &mut Reader<'_>) -> std::io::Result<Replay> {
    let mut replay = Replay { len: r.len, ..Replay::default() };
    let mut at = 0;
    while at < r.len {
        let bad = match decode_at(r, at)? {
            Ok((Op::Header(h), len)) => {
                replay.header = Some(h);
                at += len;
                replay.end = at;
                continue;
            }
            Ok((op, len)) => {
                replay.ops.push(op);
                at += len;
                replay.end = at;
                continue;
            }
            Err(bad) => bad,
        };
        if r.all_zero_from(at)? {
            break;
        }
        match next_frame(r, at + 1)? {
            Some(next) => {
                replay.damage.push(Damage { offset: at, reason: bad.reason().to_string(), resumed_at: Some(next) });
                at = next;
            }
            None => {
                if torn(r, at, &bad)? {
                    replay.torn = Some(at);
                } else {
                    replay.damage.push(Damage { offset: at, reason: bad.reason().to_string(), resumed_at: None });
                }
                break;
            }
        }
    }
    // The snapshot was fsynced whole before it became the journal: frames ending inside it were
    // lost (zeroed or cut off), never torn.
    if let Some(h) = replay.header {
        let header_len = encode(&OpRef::Header(h)).map_or(0, |f| f.len() as u64);
        let snapshot_end = header_len.saturating_add(h.bytes);
        if replay.end < snapshot_end && replay.damage.iter().all(|d| d.resumed_at.is_some()) {
            replay.torn = None;
            replay.damage.push(Damage {
                offset: replay.end,
                reason: format!(
                    "the snapshot of {} records ends at offset {snapshot_end}, but the frames end at {}: zeroed or cut off",
                    h.records, replay.end
                ),
                resumed_at: None,
            });
        }
    }
    Ok(replay)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str) -> Allocation {
        crate::state::record::tests::sample(id)
    }

    /// Frames of puts of `ids`, then zeros to 4 KiB; the frames' offsets.
    fn journal(ids: &[&str]) -> (Vec<u8>, Vec<usize>) {
        let mut buf = Vec::new();
        let mut offsets = Vec::new();
        for id in ids {
            offsets.push(buf.len());
            buf.extend(encode(&OpRef::Put(&record(id))).unwrap());
        }
        buf.resize(4096, 0);
        (buf, offsets)
    }

    fn ids(replay: &Replay) -> Vec<String> {
        replay
            .ops
            .iter()
            .map(|op| match op {
                Op::Put(a) => format!("+{}", a.id),
                Op::Remove(id) => format!("-{id}"),
                Op::Header(h) => format!("header {}", h.records),
            })
            .collect()
    }

    #[test]
    fn frames_round_trip_and_end_at_zeros() {
        let mut buf = encode(&OpRef::Put(&record("a"))).unwrap();
        let f = encode(&OpRef::Remove("a")).unwrap();
        assert_eq!(&f[HEADER_LEN..], br#"{"remove":"a"}"#);
        assert_eq!(u32_at(&f, 0), MAGIC);
        assert_eq!(u32_at(&f, 4) as usize, f.len() - HEADER_LEN);
        buf.extend(&f);
        let end = buf.len();
        buf.resize(end + 100, 0);
        let r = scan(&buf);
        assert_eq!(r.ops, [Op::Put(record("a")), Op::Remove("a".into())]);
        assert_eq!((r.end, r.torn, r.damage.len()), (end as u64, None, 0));
        let r = scan(&[]);
        assert!(r.ops.is_empty() && r.damage.is_empty() && r.torn.is_none());
    }

    #[test]
    fn capacity_is_a_floor_of_1_mib_and_4x_the_live_frames_in_64_kib_steps() {
        assert_eq!(capacity_for(0), 1 << 20);
        assert_eq!(capacity_for(100_000), 1 << 20);
        assert_eq!(capacity_for(300_000), 1_245_184); // 1.2 MB up to 19 × 64 KiB
        assert_eq!(capacity_for(300_000) % CAPACITY_STEP, 0);
    }

    #[test]
    fn a_torn_last_frame_is_dropped_quietly() {
        let (full, offsets) = journal(&["a", "b", "c"]);
        let last = offsets[2];
        let frame_end = full.iter().rposition(|&b| b != 0).unwrap() + 1;
        // Written up to a point (kill -9 between pages), or only its second half (power loss).
        for cut in [1, 3, 6, 10, 12, 40, frame_end - last - 1] {
            let mut buf = full.clone();
            buf[last + cut..].fill(0);
            let r = scan(&buf);
            assert_eq!(ids(&r), ["+a", "+b"], "cut at {cut}");
            assert_eq!((r.torn, r.damage.len()), (Some(last as u64), 0), "cut at {cut}");
            let mut buf = full.clone();
            buf[last..last + cut].fill(0);
            let r = scan(&buf);
            assert_eq!(ids(&r), ["+a", "+b"], "head lost up to {cut}");
            assert!(r.damage.is_empty(), "head lost up to {cut}: {:?}", r.damage);
        }
        // The file cut short inside the frame.
        let r = scan(&full[..last + 30]);
        assert_eq!((ids(&r), r.torn, r.damage.len()), (vec!["+a".to_string(), "+b".into()], Some(last as u64), 0));
    }

    #[test]
    fn damage_is_reported_and_the_frames_after_it_are_kept() {
        let (full, offsets) = journal(&["a", "b", "c", "d"]);
        // A byte of b's payload, b's magic, b's length.
        for at in [offsets[1] + HEADER_LEN + 20, offsets[1], offsets[1] + 5] {
            let mut buf = full.clone();
            buf[at] ^= 0x5a;
            let r = scan(&buf);
            assert_eq!(ids(&r), ["+a", "+c", "+d"], "flip at {at}");
            assert_eq!(r.damage.len(), 1, "flip at {at}");
            assert_eq!(r.damage[0].offset, offsets[1] as u64);
            assert_eq!(r.damage[0].resumed_at, Some(offsets[2] as u64));
            assert!(r.damage[0].to_string().starts_with(&format!("offset {}: ", offsets[1])), "{}", r.damage[0]);
        }
        // The last frame's checksum fails with bytes after its end: not a torn write.
        let mut buf = full.clone();
        buf[offsets[3] + HEADER_LEN + 3] ^= 1;
        let end = full.iter().rposition(|&b| b != 0).unwrap() + 1;
        buf[end + 100] = 9;
        let r = scan(&buf);
        assert_eq!(ids(&r), ["+a", "+b", "+c"]);
        assert_eq!((r.torn, r.damage.len(), r.damage[0].resumed_at), (None, 1, None));
        // Foreign bytes at the end.
        let mut buf = full.clone();
        buf[end..end + 4].copy_from_slice(b"junk");
        let r = scan(&buf);
        assert_eq!((ids(&r).len(), r.torn, r.damage.len()), (4, None, 1));
        assert!(r.damage[0].reason.contains("magic"), "{}", r.damage[0]);
        // A checksummed frame with an invalid id, between good ones.
        let mut bad = record("x");
        bad.id = "../x".into();
        let mut buf = encode(&OpRef::Put(&record("a"))).unwrap();
        let at = buf.len();
        buf.extend(frame(&serde_json::to_vec(&OpRef::Put(&bad)).unwrap()));
        buf.extend(frame(br#"{"remove":"a","put":1}"#));
        let next = buf.len();
        buf.extend(encode(&OpRef::Remove("a")).unwrap());
        buf.extend([0; 64]);
        let r = scan(&buf);
        assert_eq!(ids(&r), ["+a", "-a"]);
        assert_eq!(r.damage.len(), 1);
        assert_eq!((r.damage[0].offset, r.damage[0].resumed_at), (at as u64, Some(next as u64)));
        assert!(r.damage[0].reason.contains("invalid record"), "{}", r.damage[0]);
        // The same as the last frame: damage too, a checksummed frame is never a torn write.
        let r = scan(&buf[..next]);
        assert_eq!((r.torn, r.damage.len()), (None, 1));
    }
}
