//! Share declarations: `shares = { count = 4 }` (equal shares) or a list of sizes
//! (`[[partitions.0.shares]]` with `memory` and `sm_percent`), and byte sizes such as `"20GiB"`.

use std::fmt;

use serde::de::{self, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A size in bytes, written as a string with a unit (`"20GiB"`, `"1.5GB"`, `"512B"`;
/// `tessera_region::parse_size_with_unit`); a bare number is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // With its unit, as it must be read back.
        s.serialize_str(&format!("{}B", self.0))
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size: bytes, or a string such as \"20GiB\"")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteSize, E> {
                Err(E::custom(bare(v)))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Err(E::custom(bare(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
                tessera_region::parse_size_with_unit(v).map(ByteSize).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// Why a bare number is refused as a size: its unit is a guess (bytes? MiB, as HAMi counts?).
fn bare(v: impl fmt::Display) -> String {
    format!("{v} has no unit: write a string such as \"{v}MiB\" (MiB = 2^20 bytes), \"{v}GiB\" or \"{v}B\" (bytes)")
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const GIB: u64 = 1 << 30;
        const MIB: u64 = 1 << 20;
        if self.0 >= GIB && self.0.is_multiple_of(GIB / 4) {
            write!(f, "{}GiB", self.0 as f64 / GIB as f64)
        } else if self.0 >= MIB && self.0.is_multiple_of(MIB) {
            write!(f, "{}MiB", self.0 / MIB)
        } else {
            write!(f, "{}B", self.0)
        }
    }
}

/// One share's size; what is left out is split equally among the shares that leave it out.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShareSize {
    /// Device memory the share may hold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<ByteSize>,
    /// Percent of the device's SM time, 1..=100.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm_percent: Option<u32>,
}

/// How a device is split into shares.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum SharesSpec {
    /// `{ count = N }`: N equal shares (memory and SM time each 1/N).
    Equal {
        /// Number of shares.
        count: u32,
    },
    /// A list of sizes, one share each.
    Explicit(Vec<ShareSize>),
}

impl SharesSpec {
    /// Number of shares.
    pub fn count(&self) -> usize {
        match self {
            SharesSpec::Equal { count } => *count as usize,
            SharesSpec::Explicit(v) => v.len(),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EqualShares {
    count: u32,
}

impl<'de> Deserialize<'de> for SharesSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = SharesSpec;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("`{ count = N }` or a list of `{ memory = \"…\", sm_percent = N }`")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<SharesSpec, A::Error> {
                let e = EqualShares::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(SharesSpec::Equal { count: e.count })
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<SharesSpec, A::Error> {
                let v = Vec::<ShareSize>::deserialize(de::value::SeqAccessDeserializer::new(seq))?;
                Ok(SharesSpec::Explicit(v))
            }
        }
        d.deserialize_any(V)
    }
}
