//! Share planning: a GPU or a MIG device split into N time-sliced shares, each with a memory
//! limit and an SM percentage that `libtessera.so` enforces. Pure: sizes in, descriptors out.

use crate::config::{ShareSize, SharesSpec};

/// Memory limits are whole MiB (what a CUDA allocator can use anyway).
const MIB: u64 = 1 << 20;

/// One share of a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    /// Stable across restarts: `<parent uuid>::<n>` (the time-slicing convention).
    pub id: String,
    /// The GPU (`GPU-…`) or MIG device (`MIG-…`) it is a share of.
    pub parent_uuid: String,
    /// Position among the parent's shares.
    pub index: u32,
    /// Device memory it may hold, in bytes.
    pub memory_limit: u64,
    /// Percent of the parent's SM time.
    pub sm_percent: u32,
}

impl Share {
    /// The shim's per-device limits for this share.
    pub fn device_limits(&self) -> tessera_region::DeviceLimits {
        tessera_region::DeviceLimits {
            uuid: self.parent_uuid.clone(),
            memory_limit: Some(self.memory_limit),
            sm_percent: Some(self.sm_percent),
        }
    }
}

/// Why shares do not fit their device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShareError {
    #[error("the shares' memory sums to {}, more than the device's {}", tessera_region::human_size(*wanted), tessera_region::human_size(*available))]
    MemoryOver { wanted: u64, available: u64 },
    #[error("{open} shares without a memory size share {}: less than 1 MiB each", tessera_region::human_size(*left))]
    MemoryTooSmall { open: usize, left: u64 },
    #[error("no shares declared")]
    Empty,
}

/// Plans the shares of one device of `memory` bytes. Equal shares split memory (in whole MiB)
/// and SM time (whole percent, the remainder to the first shares) evenly; in a list, what a
/// share leaves out is split evenly among the shares that leave it out.
pub fn plan_shares(parent_uuid: &str, memory: u64, spec: &SharesSpec) -> Result<Vec<Share>, ShareError> {
    let sizes: Vec<ShareSize> = match spec {
        SharesSpec::Equal { count } => vec![ShareSize::default(); *count as usize],
        SharesSpec::Explicit(list) => list.clone(),
    };
    if sizes.is_empty() {
        return Err(ShareError::Empty);
    }
    let fixed_mem: u64 = sizes.iter().filter_map(|s| s.memory).map(|m| m.0).sum();
    if fixed_mem > memory {
        return Err(ShareError::MemoryOver { wanted: fixed_mem, available: memory });
    }
    let open_mem = sizes.iter().filter(|s| s.memory.is_none()).count();
    let each_mem = if open_mem == 0 { 0 } else { (memory - fixed_mem) / open_mem as u64 / MIB * MIB };
    if open_mem > 0 && each_mem == 0 {
        return Err(ShareError::MemoryTooSmall { open: open_mem, left: memory - fixed_mem });
    }
    let fixed_sm: u32 = sizes.iter().filter_map(|s| s.sm_percent).sum();
    let open_sm = sizes.iter().filter(|s| s.sm_percent.is_none()).count() as u32;
    let left_sm = 100u32.saturating_sub(fixed_sm);
    let (each_sm, mut extra_sm) =
        (left_sm.checked_div(open_sm).unwrap_or(0), left_sm.checked_rem(open_sm).unwrap_or(0));
    Ok(sizes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let sm_percent = s.sm_percent.unwrap_or_else(|| {
                let bonus = u32::from(extra_sm > 0);
                extra_sm = extra_sm.saturating_sub(1);
                (each_sm + bonus).max(1)
            });
            Share {
                id: format!("{parent_uuid}::{i}"),
                parent_uuid: parent_uuid.to_string(),
                index: i as u32,
                memory_limit: s.memory.map_or(each_mem, |m| m.0),
                sm_percent,
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ByteSize;

    const GIB: u64 = 1 << 30;

    #[test]
    fn equal_shares_split_memory_and_time() {
        let s = plan_shares("GPU-a", 80 * GIB, &SharesSpec::Equal { count: 4 }).unwrap();
        assert_eq!(s.len(), 4);
        assert!(s.iter().all(|x| x.memory_limit == 20 * GIB && x.sm_percent == 25));
        assert_eq!(s[3].id, "GPU-a::3");
        assert_eq!(s[3].parent_uuid, "GPU-a");
        let three = plan_shares("GPU-a", 80 * GIB, &SharesSpec::Equal { count: 3 }).unwrap();
        assert_eq!(three.iter().map(|x| x.sm_percent).collect::<Vec<_>>(), vec![34, 33, 33]);
        assert!(three.iter().all(|x| x.memory_limit % MIB == 0 && x.memory_limit * 3 <= 80 * GIB));
    }

    #[test]
    fn explicit_sizes_and_the_rest_split() {
        let spec = SharesSpec::Explicit(vec![
            ShareSize { memory: Some(ByteSize(40 * GIB)), sm_percent: Some(50) },
            ShareSize { memory: None, sm_percent: None },
            ShareSize { memory: None, sm_percent: Some(10) },
        ]);
        let s = plan_shares("MIG-x", 80 * GIB, &spec).unwrap();
        assert_eq!((s[0].memory_limit, s[0].sm_percent), (40 * GIB, 50));
        assert_eq!((s[1].memory_limit, s[1].sm_percent), (20 * GIB, 40));
        assert_eq!((s[2].memory_limit, s[2].sm_percent), (20 * GIB, 10));
        assert_eq!(s[1].device_limits().uuid, "MIG-x");
    }

    #[test]
    fn shares_that_do_not_fit_are_refused() {
        let spec = SharesSpec::Explicit(vec![ShareSize { memory: Some(ByteSize(50 * GIB)), sm_percent: None }; 2]);
        assert_eq!(
            plan_shares("GPU-a", 80 * GIB, &spec),
            Err(ShareError::MemoryOver { wanted: 100 * GIB, available: 80 * GIB })
        );
        let e = ShareError::MemoryOver { wanted: 100 * GIB, available: 80 * GIB }.to_string();
        assert!(e.contains("sums to 100 GiB, more than the device's 80 GiB"), "sizes for people: {e}");
        let spec = SharesSpec::Explicit(vec![
            ShareSize { memory: Some(ByteSize(80 * GIB)), sm_percent: None },
            ShareSize::default(),
        ]);
        assert!(matches!(plan_shares("GPU-a", 80 * GIB, &spec), Err(ShareError::MemoryTooSmall { .. })));
    }
}
