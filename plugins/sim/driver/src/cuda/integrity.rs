//! The answer to the CUDA runtime's integrity check (entry 1 of the driver's `INTEGRITY_CHECK`
//! export table): libcudart asks the driver for a keyed digest of facts both sides know (the
//! check's version, a timestamp, the driver's CUDA version, the calling process and thread, the
//! addresses of the tables it was given, and each device's UUID and PCI location), computes the
//! same digest itself, and refuses to run (every runtime call then fails) when they differ.
//!
//! The digest is HMAC over MD2 (RFC 1319) with a fixed 16-byte key: the check is an
//! authentication of the driver, not a secret. Open re-implementations of the driver document its
//! inputs and layout; this is our own implementation of the published algorithms.

/// MD2's substitution table (RFC 1319, from the digits of pi).
const S: [u8; 256] = [
    41, 46, 67, 201, 162, 216, 124, 1, 61, 54, 84, 161, 236, 240, 6, 19, 98, 167, 5, 243, 192, 199, 115, 140, 152, 147,
    43, 217, 188, 76, 130, 202, 30, 155, 87, 60, 253, 212, 224, 22, 103, 66, 111, 24, 138, 23, 229, 18, 190, 78, 196,
    214, 218, 158, 222, 73, 160, 251, 245, 142, 187, 47, 238, 122, 169, 104, 121, 145, 21, 178, 7, 63, 148, 194, 16,
    137, 11, 34, 95, 33, 128, 127, 93, 154, 90, 144, 50, 39, 53, 62, 204, 231, 191, 247, 151, 3, 255, 25, 48, 179, 72,
    165, 181, 209, 215, 94, 146, 42, 172, 86, 170, 198, 79, 184, 56, 210, 150, 164, 125, 182, 118, 252, 107, 226, 156,
    116, 4, 241, 69, 157, 112, 89, 100, 113, 135, 32, 134, 91, 207, 101, 230, 45, 168, 2, 27, 96, 37, 173, 174, 176,
    185, 246, 28, 70, 97, 105, 52, 64, 126, 15, 85, 71, 163, 35, 221, 81, 175, 58, 195, 92, 249, 206, 186, 197, 234,
    38, 44, 83, 13, 110, 133, 40, 132, 9, 211, 223, 205, 244, 65, 129, 77, 82, 106, 220, 55, 200, 108, 193, 171, 250,
    36, 225, 123, 8, 12, 189, 177, 74, 120, 136, 149, 139, 227, 99, 232, 109, 233, 203, 213, 254, 59, 0, 29, 57, 242,
    239, 183, 14, 102, 88, 208, 228, 166, 119, 114, 248, 235, 117, 75, 10, 49, 68, 80, 180, 143, 237, 31, 26, 219, 153,
    141, 51, 159, 17, 131, 20,
];

/// MD2 over a stream of bytes.
struct Md2 {
    state: [u8; 48],
    checksum: [u8; 16],
    block: [u8; 16],
    filled: usize,
}

impl Md2 {
    fn new() -> Md2 {
        Md2 { state: [0; 48], checksum: [0; 16], block: [0; 16], filled: 0 }
    }

    fn compress(&mut self, block: &[u8; 16]) {
        for (j, &b) in block.iter().enumerate() {
            self.state[16 + j] = b;
            self.state[32 + j] = b ^ self.state[j];
        }
        let mut t = 0u8;
        for round in 0..18u8 {
            for x in self.state.iter_mut() {
                *x ^= S[t as usize];
                t = *x;
            }
            t = t.wrapping_add(round);
        }
    }

    fn update(&mut self, data: &[u8]) {
        for &b in data {
            self.block[self.filled] = b;
            self.filled += 1;
            if self.filled == 16 {
                let block = self.block;
                self.compress(&block);
                let mut last = self.checksum[15];
                for (c, &m) in self.checksum.iter_mut().zip(&block) {
                    *c ^= S[(m ^ last) as usize];
                    last = *c;
                }
                self.filled = 0;
            }
        }
    }

    fn finish(mut self) -> [u8; 16] {
        let pad = (16 - self.filled) as u8;
        self.update(&vec![pad; pad as usize]);
        let checksum = self.checksum;
        self.compress(&checksum);
        self.state[..16].try_into().expect("16 bytes")
    }
}

/// HMAC (RFC 2104) over MD2, whose block is 16 bytes: the key is one block.
fn hmac_md2(key: &[u8; 16], message: &[u8]) -> [u8; 16] {
    let mut inner = Md2::new();
    inner.update(&key.map(|k| k ^ 0x36));
    inner.update(message);
    let inner = inner.finish();
    let mut outer = Md2::new();
    outer.update(&key.map(|k| k ^ 0x5c));
    outer.update(&inner);
    outer.finish()
}

/// The key libcudart and the driver share.
const KEY: [u8; 16] = [0x14, 0x6A, 0xDD, 0xAE, 0x53, 0xA9, 0xA7, 0x52, 0xAA, 0x08, 0x41, 0x36, 0x0B, 0xF5, 0x5A, 0x9F];

/// What the runtime and the driver both know, in the order and layout they hash it.
pub(crate) struct Facts {
    /// The check's version, as the runtime passed it.
    pub version: u32,
    /// The timestamp the runtime passed (Unix seconds).
    pub unix_seconds: u64,
    /// `cuDriverGetVersion`'s answer.
    pub driver_version: u32,
    pub pid: u32,
    /// The low 32 bits of the calling thread's `pthread_t`.
    pub thread: u32,
    pub cudart_table: usize,
    pub integrity_table: usize,
    pub check_fn: usize,
    /// Per device, in ordinal order: UUID, PCI domain, bus, device.
    pub devices: Vec<([u8; 16], i32, i32, i32)>,
}

/// The two words the driver answers with.
pub(crate) fn answer(f: &Facts) -> [u64; 2] {
    // Versions ending in 0 and 1 (the first two revisions of the check) expect fixed words.
    match f.version % 10 {
        0 => return [0x3341_181C_03CB_675C, 0x8ED3_83AA_1F4C_D1E8],
        1 => return [0x1841_181C_03CB_675C, 0x8ED3_83AA_1F4C_D1E8],
        _ => {}
    }
    // A C struct of four u32, three pointers and a u64 (48 bytes, no padding), then one
    // 28-byte struct (16-byte UUID, three i32) per device; native byte order.
    let mut m = Vec::with_capacity(48 + 28 * f.devices.len());
    for w in [f.driver_version, f.version, f.pid, f.thread] {
        m.extend_from_slice(&w.to_ne_bytes());
    }
    for p in [f.cudart_table, f.integrity_table, f.check_fn] {
        m.extend_from_slice(&(p as u64).to_ne_bytes());
    }
    m.extend_from_slice(&f.unix_seconds.to_ne_bytes());
    for (uuid, domain, bus, device) in &f.devices {
        m.extend_from_slice(uuid);
        for v in [domain, bus, device] {
            m.extend_from_slice(&v.to_ne_bytes());
        }
    }
    let d = hmac_md2(&KEY, &m);
    [u64::from_ne_bytes(d[..8].try_into().expect("8 bytes")), u64::from_ne_bytes(d[8..].try_into().expect("8 bytes"))]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(d: [u8; 16]) -> String {
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn md2(data: &[u8]) -> String {
        let mut h = Md2::new();
        h.update(data);
        hex(h.finish())
    }

    #[test]
    fn md2_matches_the_rfc_test_suite() {
        assert_eq!(md2(b""), "8350e5a3e24c153df2275c9f80692773");
        assert_eq!(md2(b"a"), "32ec01ec4a6dac72c0ab96fb34c0b5d1");
        assert_eq!(md2(b"abc"), "da853b0d3f88d99b30283a69e6ded6bb");
        assert_eq!(md2(b"message digest"), "ab4f496bfb2a530b219ff33031fe06b0");
        assert_eq!(md2(b"abcdefghijklmnopqrstuvwxyz"), "4e8ddff3650292ab5a4108c3aa47940b");
        assert_eq!(
            md2(b"12345678901234567890123456789012345678901234567890123456789012345678901234567890"),
            "d5976f79d83d3a0dc9806c3c66f3efd8"
        );
    }

    #[test]
    fn md2_is_the_same_fed_in_pieces() {
        let data: Vec<u8> = (0..100u8).collect();
        let mut h = Md2::new();
        for piece in data.chunks(7) {
            h.update(piece);
        }
        assert_eq!(hex(h.finish()), md2(&data));
    }

    fn facts() -> Facts {
        Facts {
            version: 12082,
            unix_seconds: 0x682b_9cee,
            driver_version: 12080,
            pid: 4242,
            thread: 0xf79c_1000,
            cudart_table: 0x7fff_f695_8240,
            integrity_table: 0x7fff_f695_8220,
            check_fn: 0x7fff_f2aa_f4a0,
            devices: vec![([7; 16], 0, 0x18, 0), ([9; 16], 0, 0x2a, 0)],
        }
    }

    #[test]
    fn every_fact_changes_the_answer() {
        let base = answer(&facts());
        let changes: [fn(&mut Facts); 9] = [
            |f| f.version = 12092,
            |f| f.unix_seconds += 1,
            |f| f.driver_version = 12090,
            |f| f.pid += 1,
            |f| f.thread ^= 1,
            |f| f.cudart_table += 8,
            |f| f.check_fn += 8,
            |f| f.devices[1].2 = 0x2b,
            |f| f.devices.pop().map_or((), drop),
        ];
        for (i, change) in changes.iter().enumerate() {
            let mut f = facts();
            change(&mut f);
            assert_ne!(answer(&f), base, "change {i} left the answer as it was");
        }
        assert_eq!(answer(&facts()), base);
    }

    #[test]
    fn first_revisions_get_fixed_words() {
        let mut f = facts();
        f.version = 12080;
        assert_eq!(answer(&f), [0x3341_181C_03CB_675C, 0x8ED3_83AA_1F4C_D1E8]);
        f.version = 12071;
        assert_eq!(answer(&f)[0], 0x1841_181C_03CB_675C);
    }
}
