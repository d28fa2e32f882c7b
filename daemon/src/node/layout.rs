//! Layouts as the node API speaks them (`tessera.v1.GpuLayout`) and as the configuration
//! declares them ([`PartitionSpec`]): conversions both ways, and the layout a GPU is in now.
//! A layout asked for through the API becomes a configuration entry, so one code path (resolve,
//! plan, apply) serves the file, reloads and the API alike.

use std::collections::BTreeMap;

use tessera_proto::tessera::v1 as api;

use crate::config::{ByteSize, PartitionSpec, ShareSize, SharesSpec};
use crate::discovery::Gpu;
use crate::partition::Share;

/// The configuration entry for an API layout; the error names the field.
pub fn spec_from_api(layout: &api::GpuLayout) -> Result<PartitionSpec, String> {
    use api::gpu_layout::Layout;
    match &layout.layout {
        None => Err("layout: none of whole, mig, shares is set".into()),
        Some(Layout::Whole(_)) => Ok(PartitionSpec { whole: true, ..Default::default() }),
        Some(Layout::Shares(s)) => {
            Ok(PartitionSpec { shares: Some(shares_from_api("layout.shares", s)?), ..Default::default() })
        }
        Some(Layout::Mig(m)) => {
            let mut profiles = BTreeMap::new();
            let mut mig_shares = BTreeMap::new();
            for (i, p) in m.profiles.iter().enumerate() {
                let at = format!("layout.mig.profiles[{i}]");
                if p.profile.is_empty() {
                    return Err(format!("{at}.profile: empty"));
                }
                if !crate::config::is_profile_name(&p.profile) {
                    return Err(format!("{at}.profile: {:?} is not a MIG profile name (like 1g.10gb)", p.profile));
                }
                if p.count == 0 {
                    return Err(format!("{at}.count: must be at least 1"));
                }
                if profiles.insert(p.profile.clone(), p.count).is_some() {
                    return Err(format!("{at}.profile: {} is listed twice", p.profile));
                }
                if let Some(s) = &p.shares {
                    mig_shares.insert(p.profile.clone(), shares_from_api(&format!("{at}.shares"), s)?);
                }
            }
            Ok(PartitionSpec {
                mig: Some(profiles),
                mig_shares: (!mig_shares.is_empty()).then_some(mig_shares),
                ..Default::default()
            })
        }
    }
}

fn shares_from_api(at: &str, s: &api::SharesLayout) -> Result<SharesSpec, String> {
    if s.count == 0 {
        return Err(format!("{at}.count: must be at least 1"));
    }
    if s.count > crate::config::MAX_SHARES {
        return Err(format!("{at}.count: {} is over the limit of {}", s.count, crate::config::MAX_SHARES));
    }
    if s.sizes.is_empty() {
        return Ok(SharesSpec::Equal { count: s.count });
    }
    if s.sizes.len() != s.count as usize {
        return Err(format!("{at}.sizes: {} sizes for {} shares; give one per share or none", s.sizes.len(), s.count));
    }
    let mut sizes = Vec::new();
    for (i, z) in s.sizes.iter().enumerate() {
        if let Some(p) = z.sm_percent
            && !(1..=100).contains(&p)
        {
            return Err(format!("{at}.sizes[{i}].sm_percent: {p} is not within 1..=100"));
        }
        if z.memory_bytes == Some(0) {
            return Err(format!("{at}.sizes[{i}].memory_bytes: must be more than 0"));
        }
        sizes.push(ShareSize { memory: z.memory_bytes.map(ByteSize), sm_percent: z.sm_percent });
    }
    Ok(SharesSpec::Explicit(sizes))
}

/// The API layout for a configuration entry.
pub fn api_from_spec(spec: &PartitionSpec) -> api::GpuLayout {
    use api::gpu_layout::Layout;
    let layout = if let Some(profiles) = &spec.mig {
        Layout::Mig(api::MigLayout {
            profiles: profiles
                .iter()
                .map(|(profile, &count)| api::MigProfileCount {
                    profile: profile.clone(),
                    count,
                    shares: spec.mig_shares.as_ref().and_then(|m| m.get(profile)).map(api_shares),
                })
                .collect(),
        })
    } else if let Some(s) = &spec.shares {
        Layout::Shares(api_shares(s))
    } else {
        Layout::Whole(api::WholeLayout {})
    };
    api::GpuLayout { layout: Some(layout) }
}

fn api_shares(s: &SharesSpec) -> api::SharesLayout {
    match s {
        SharesSpec::Equal { count } => api::SharesLayout { count: *count, sizes: Vec::new() },
        SharesSpec::Explicit(v) => api::SharesLayout {
            count: v.len() as u32,
            sizes: v
                .iter()
                .map(|z| api::ShareSize { memory_bytes: z.memory.map(|b| b.0), sm_percent: z.sm_percent })
                .collect(),
        },
    }
}

/// What `gpu` is now, as a configuration entry: its MIG instances by profile (with the shares
/// carved from them), else its shares, else whole. Shares are described by their sizes, so the
/// entry re-plans to the same shares.
pub fn current_spec(gpu: &Gpu, shares: &[Share]) -> PartitionSpec {
    let sized = |list: Vec<&Share>| {
        SharesSpec::Explicit(
            list.iter()
                .map(|s| ShareSize { memory: Some(ByteSize(s.memory_limit)), sm_percent: Some(s.sm_percent) })
                .collect(),
        )
    };
    if let Some(mig) = gpu.mig.as_ref().filter(|m| m.current) {
        let mut profiles: BTreeMap<String, u32> = BTreeMap::new();
        let mut mig_shares = BTreeMap::new();
        for gi in &mig.instances {
            *profiles.entry(gi.profile.clone()).or_default() += 1;
            for d in &gi.devices {
                let mine: Vec<&Share> = shares.iter().filter(|s| s.parent_uuid == d.uuid).collect();
                if !mine.is_empty() {
                    mig_shares.entry(gi.profile.clone()).or_insert_with(|| sized(mine));
                }
            }
        }
        return PartitionSpec {
            mig: Some(profiles),
            mig_shares: (!mig_shares.is_empty()).then_some(mig_shares),
            ..Default::default()
        };
    }
    let mine: Vec<&Share> = shares.iter().filter(|s| s.parent_uuid == gpu.uuid).collect();
    if mine.is_empty() {
        PartitionSpec { whole: true, ..Default::default() }
    } else {
        PartitionSpec { shares: Some(sized(mine)), ..Default::default() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use api::gpu_layout::Layout;

    #[test]
    fn api_layouts_round_trip_and_bad_ones_name_the_field() {
        let mig = api::GpuLayout {
            layout: Some(Layout::Mig(api::MigLayout {
                profiles: vec![
                    api::MigProfileCount { profile: "1g.10gb".into(), count: 2, shares: None },
                    api::MigProfileCount {
                        profile: "3g.40gb".into(),
                        count: 1,
                        shares: Some(api::SharesLayout { count: 2, sizes: vec![] }),
                    },
                ],
            })),
        };
        let spec = spec_from_api(&mig).unwrap();
        assert_eq!(spec.mig.as_ref().unwrap()["1g.10gb"], 2);
        assert_eq!(spec.mig_shares.as_ref().unwrap()["3g.40gb"], SharesSpec::Equal { count: 2 });
        assert_eq!(api_from_spec(&spec), mig);

        let bad = |layout: Layout| spec_from_api(&api::GpuLayout { layout: Some(layout) }).unwrap_err();
        let e = bad(Layout::Shares(api::SharesLayout { count: 0, sizes: vec![] }));
        assert!(e.starts_with("layout.shares.count"), "{e}");
        let e = bad(Layout::Shares(api::SharesLayout {
            count: 2,
            sizes: vec![api::ShareSize { memory_bytes: None, sm_percent: Some(101) }; 2],
        }));
        assert!(e.starts_with("layout.shares.sizes[0].sm_percent"), "{e}");
        let e = bad(Layout::Mig(api::MigLayout {
            profiles: vec![api::MigProfileCount { profile: "big".into(), count: 1, shares: None }],
        }));
        assert!(e.contains("profiles[0].profile") && e.contains("big"), "{e}");
        assert!(spec_from_api(&api::GpuLayout { layout: None }).unwrap_err().contains("none of"));
    }
}
