//! Shares carved on demand (the node API's `Allocate` and `SetLimits`): which GPU has room for
//! a memory size and an SM percent, by the records of every allocation on it, whoever made them.
//!
//! Admission, per GPU: the memory limits of its allocations add up to at most its memory (an
//! allocation without a memory limit, a whole GPU, counts as all of it), and the SM percents of
//! its strict allocations add up to at most 100 (a strict one without a percent counts as 100;
//! work-conserving percents are guarantees lent out when idle, so they are not summed). Pure:
//! the allocator calls it under its store lock, so two requests never both take the last room.

use crate::config::Placement;
use crate::state::Allocation;
use crate::state::load::Loads;
use tessera_region::ComputeMode;

/// A GPU shares can be carved from, as the controller sees it now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuRoom {
    pub index: u32,
    pub uuid: String,
    /// The product name (a request may name a model).
    pub model: String,
    pub memory_total: u64,
    /// Why nothing can be allocated on it (unhealthy); `None`: it can.
    pub unavailable: Option<String>,
    /// MIG mode is on (or pending a reset): no share is carved from it, nor is it given whole;
    /// its MIG devices are in `mig`.
    pub mig_mode: bool,
    /// Its MIG devices, as Allocate hands them out whole.
    pub mig: Vec<MigSlot>,
    /// The GPU-instance profiles the board offers (empty: no MIG), so that a request for a
    /// profile no GPU has is told so, not told to make instances of it.
    pub mig_profiles: Vec<String>,
    /// The host device nodes a container needs for it.
    pub nodes: Vec<std::path::PathBuf>,
}

/// One MIG device of a GPU in MIG mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigSlot {
    pub uuid: String,
    /// Its GPU instance profile, e.g. `3g.40gb`.
    pub profile: String,
    pub memory_total: u64,
    /// Why it cannot be handed out (unhealthy); `None`: it can.
    pub unavailable: Option<String>,
}

/// The allocations (ids) holding device `uuid`: as their device, or as a share's parent.
fn holders<'a>(uuid: &str, records: &[&'a Allocation]) -> Vec<&'a str> {
    records
        .iter()
        .filter(|a| {
            a.devices
                .iter()
                .any(|d| d.physical_uuid.eq_ignore_ascii_case(uuid) || d.device_id.eq_ignore_ascii_case(uuid))
        })
        .map(|a| a.id.as_str())
        .collect()
}

/// What one allocation asks of one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    pub memory: u64,
    pub sm_percent: u32,
    pub compute_mode: ComputeMode,
}

/// What a GPU's allocations hold: memory limits and strict SM percents, summed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    pub memory: u64,
    pub strict_sm: u32,
}

/// What the records other than `except` hold on `gpu`.
pub fn held<'a>(gpu: &GpuRoom, records: impl IntoIterator<Item = &'a Allocation>, except: Option<&str>) -> Held {
    let mut h = Held::default();
    for a in records.into_iter().filter(|a| Some(a.id.as_str()) != except) {
        for d in a.devices.iter().filter(|d| d.physical_uuid.eq_ignore_ascii_case(&gpu.uuid)) {
            let (memory, strict_sm) = d.holds();
            h.memory = h.memory.saturating_add(memory.unwrap_or(gpu.memory_total));
            h.strict_sm = h.strict_sm.saturating_add(strict_sm);
        }
    }
    h
}

/// What the records counted in `loads` (the store's) hold on `gpu`, less `except` (a stored
/// record): the figures [`held`] gives over the same records, read from the sums instead of
/// scanning every record.
pub fn held_in(gpu: &GpuRoom, loads: &Loads, except: Option<&Allocation>) -> Held {
    let load = match except {
        Some(a) => loads.device_except(&gpu.uuid, a),
        None => loads.device(&gpu.uuid),
    };
    let (memory, strict_sm) = load.held(gpu.memory_total);
    Held { memory, strict_sm }
}

/// Whether `ask` fits beside `held` on `gpu`.
pub fn fits(gpu: &GpuRoom, held: Held, ask: Ask) -> bool {
    let memory_ok = held.memory.checked_add(ask.memory).is_some_and(|m| m <= gpu.memory_total);
    let sm_ok = ask.compute_mode != ComputeMode::Strict || held.strict_sm.saturating_add(ask.sm_percent) <= 100;
    memory_ok && sm_ok
}

/// Whether GPU `gpu` is what `selector` names: an index, a UUID (any case), or a model name
/// (a case-insensitive part of the product name); empty names every GPU.
pub fn selects(selector: &str, gpu: &GpuRoom) -> bool {
    let s = selector.trim();
    s.is_empty()
        || s.parse::<u32>().is_ok_and(|i| i == gpu.index)
        || s.eq_ignore_ascii_case(&gpu.uuid)
        || (s.parse::<u32>().is_err()
            && !s.to_ascii_uppercase().starts_with("GPU-")
            && gpu.model.to_ascii_lowercase().contains(&s.to_ascii_lowercase()))
}

/// The GPU to carve `ask` from: among those `selector` names that have room (what each holds:
/// `held_of`, i.e. [`held_in`] the store's loads), the fullest (`Packed`) or the emptiest
/// (`Spread`) by memory, ties by index. `Err` says why none fits, naming each candidate GPU and
/// what it has free.
pub fn place<'g>(
    gpus: &'g [GpuRoom],
    held_of: impl Fn(&GpuRoom) -> Held,
    selector: &str,
    ask: Ask,
    placement: Placement,
) -> Result<&'g GpuRoom, String> {
    let named: Vec<&GpuRoom> = gpus.iter().filter(|g| selects(selector, g)).collect();
    if named.is_empty() {
        let what = if selector.trim().is_empty() {
            "this node has no GPU".to_string()
        } else {
            format!(
                "gpu: no GPU {} on this node (an index, a GPU UUID or a model name)",
                crate::client_input::quoted(selector)
            )
        };
        return Err(what);
    }
    let mut best: Option<(&GpuRoom, u64)> = None;
    let mut why = Vec::new();
    for g in named {
        if let Some(reason) = &g.unavailable {
            why.push(format!("GPU {} ({}): {reason}", g.index, g.uuid));
            continue;
        }
        if g.mig_mode {
            why.push(format!(
                "GPU {} ({}): MIG mode is on (shares are carved from GPUs with MIG off; ask for a MIG profile)",
                g.index, g.uuid
            ));
            continue;
        }
        let h = held_of(g);
        let free = g.memory_total.saturating_sub(h.memory);
        if !fits(g, h, ask) {
            why.push(format!(
                "GPU {} ({}): {} of {} free, {}% SM free",
                g.index,
                g.uuid,
                size(free),
                size(g.memory_total),
                100u32.saturating_sub(h.strict_sm)
            ));
            continue;
        }
        let better = match (best, placement) {
            (None, _) => true,
            (Some((_, f)), Placement::Packed) => free < f,
            (Some((_, f)), Placement::Spread) => free > f,
        };
        if better {
            best = Some((g, free));
        }
    }
    best.map(|(g, _)| g).ok_or_else(|| {
        let mode = if ask.compute_mode == ComputeMode::Strict { "strict" } else { "work-conserving" };
        format!("no GPU has room for {} and {}% SM ({mode}): {}", size(ask.memory), ask.sm_percent, why.join("; "))
    })
}

/// The GPUs `selector` names, or why there are none.
fn named<'g>(gpus: &'g [GpuRoom], selector: &str) -> Result<Vec<&'g GpuRoom>, String> {
    let named: Vec<&GpuRoom> = gpus.iter().filter(|g| selects(selector, g)).collect();
    if named.is_empty() {
        return Err(if selector.trim().is_empty() {
            "this node has no GPU".to_string()
        } else {
            format!(
                "gpu: no GPU {} on this node (an index, a GPU UUID or a model name)",
                crate::client_input::quoted(selector)
            )
        });
    }
    Ok(named)
}

/// `count` whole GPUs among those `selector` names: healthy, MIG off, and held by no allocation
/// at all (a GPU with any share on it is not given whole; while held whole, its full memory and
/// 100% strict SM count against it, so nothing is carved from it). Lowest indexes first. `Err`
/// names each candidate GPU and what holds it.
pub fn place_whole<'g>(
    gpus: &'g [GpuRoom],
    records: &[&Allocation],
    selector: &str,
    count: u32,
) -> Result<Vec<&'g GpuRoom>, String> {
    let named = named(gpus, selector)?;
    let mut free = Vec::new();
    let mut why = Vec::new();
    for g in named.iter().copied() {
        let held_by = holders(&g.uuid, records);
        if let Some(reason) = &g.unavailable {
            why.push(format!("GPU {} ({}): {reason}", g.index, g.uuid));
        } else if g.mig_mode {
            why.push(format!("GPU {} ({}): MIG mode is on (ask for a MIG profile)", g.index, g.uuid));
        } else if !held_by.is_empty() {
            let h = held(g, records.iter().copied(), None);
            why.push(format!(
                "GPU {} ({}): held by {} ({} of {} and {}% strict SM)",
                g.index,
                g.uuid,
                held_by.join(", "),
                size(h.memory.min(g.memory_total)),
                size(g.memory_total),
                h.strict_sm.min(100)
            ));
        } else {
            free.push(g);
        }
    }
    if free.len() >= count as usize {
        free.truncate(count as usize);
        return Ok(free);
    }
    let plural = if count == 1 { "" } else { "s" };
    let mut msg = format!("{count} whole GPU{plural} asked, {} free of the {} named", free.len(), named.len());
    if !why.is_empty() {
        msg.push_str(&format!(": {}", why.join("; ")));
    }
    Err(msg)
}

/// A free MIG device of `profile` on a GPU `selector` names (lowest GPU index, then the order
/// NVML lists them). `Err` says what each GPU in MIG mode has of that profile and who holds it,
/// or which profiles exist when none of that name does.
pub fn place_mig<'g>(
    gpus: &'g [GpuRoom],
    records: &[&Allocation],
    selector: &str,
    profile: &str,
) -> Result<(&'g GpuRoom, &'g MigSlot), String> {
    let named = named(gpus, selector)?;
    let mut why = Vec::new();
    for g in named.iter().copied() {
        if let Some(reason) = &g.unavailable {
            why.push(format!("GPU {} ({}): {reason}", g.index, g.uuid));
            continue;
        }
        if !g.mig_mode {
            why.push(format!("GPU {} ({}): MIG mode is off", g.index, g.uuid));
            continue;
        }
        let of_profile: Vec<&MigSlot> = g.mig.iter().filter(|m| m.profile.eq_ignore_ascii_case(profile)).collect();
        let mut taken = Vec::new();
        for m in &of_profile {
            if m.unavailable.is_none() && holders(&m.uuid, records).is_empty() {
                return Ok((g, m));
            }
            match &m.unavailable {
                Some(reason) => taken.push(format!("{} {reason}", m.uuid)),
                None => taken.push(format!("{} held by {}", m.uuid, holders(&m.uuid, records).join(", "))),
            }
        }
        why.push(if of_profile.is_empty() {
            format!("GPU {} ({}): no {profile} instance", g.index, g.uuid)
        } else {
            format!("GPU {} ({}): {}", g.index, g.uuid, taken.join(", "))
        });
    }
    let mut msg = format!("no free MIG device of profile {profile}: {}", why.join("; "));
    let mut present: Vec<&str> = named.iter().flat_map(|g| g.mig.iter().map(|m| m.profile.as_str())).collect();
    present.sort_unstable();
    present.dedup();
    let mut offered: Vec<&str> = named.iter().flat_map(|g| g.mig_profiles.iter().map(String::as_str)).collect();
    offered.sort_unstable();
    offered.dedup();
    if !offered.iter().any(|p| p.eq_ignore_ascii_case(profile)) {
        // A typo or another board's profile: making instances of it would fail too.
        msg.push_str(&match offered.is_empty() {
            true => ". No GPU named supports MIG".to_owned(),
            false => format!(". No GPU named has a MIG profile {profile:?}; they have: {}", offered.join(", ")),
        });
    } else if !named.iter().any(|g| g.mig_mode) {
        msg.push_str(&format!(
            ". No GPU named is in MIG mode: `tessera layout apply --gpu <GPU> --mig {profile}=<COUNT>` makes instances"
        ));
    } else if !present.iter().any(|p| p.eq_ignore_ascii_case(profile)) {
        let listed = if present.is_empty() { "none".to_owned() } else { present.join(", ") };
        msg.push_str(&format!(". The instances here are of the profiles: {listed}"));
    }
    Err(msg)
}

/// A size for people: whole GiB or MiB when exact, bytes under a MiB, else MiB with one decimal.
pub fn size(bytes: u64) -> String {
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    if bytes >= GIB && bytes.is_multiple_of(GIB) {
        format!("{} GiB", bytes / GIB)
    } else if bytes.is_multiple_of(MIB) {
        format!("{} MiB", bytes / MIB)
    } else if bytes < MIB {
        // Not "0.0 MiB" for a share of a few bytes.
        format!("{bytes} B")
    } else {
        format!("{:.1} MiB", bytes as f64 / MIB as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::record::tests::dev;
    use crate::state::{Allocation, ContainerIdentity, Source};

    const GIB: u64 = 1 << 30;

    fn gpu(index: u32, gib: u64) -> GpuRoom {
        GpuRoom {
            index,
            uuid: format!("GPU-{index}"),
            model: "NVIDIA H100 80GB HBM3".into(),
            memory_total: gib * GIB,
            unavailable: None,
            mig_mode: false,
            mig: Vec::new(),
            mig_profiles: ["1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"].map(String::from).to_vec(),
            nodes: Vec::new(),
        }
    }

    fn mig_gpu(index: u32, profiles: &[&str]) -> GpuRoom {
        let mut g = gpu(index, 80);
        g.mig_mode = true;
        g.mig = profiles
            .iter()
            .enumerate()
            .map(|(i, p)| MigSlot {
                uuid: format!("MIG-{index}-{i}"),
                profile: (*p).into(),
                memory_total: 40 * GIB,
                unavailable: None,
            })
            .collect();
        g
    }

    fn record(id: &str, devices: Vec<crate::state::AllocatedDevice>) -> Allocation {
        Allocation {
            id: id.into(),
            resource: "r".into(),
            container: ContainerIdentity::default(),
            source: Source::Kubelet,
            created_unix_ns: 0,
            devices,
            claim: None,
        }
    }

    /// What each GPU holds, by a scan of `records`.
    fn scan<'a>(records: &'a [&'a Allocation]) -> impl Fn(&GpuRoom) -> Held + 'a {
        move |g| held(g, records.iter().copied(), None)
    }

    fn ask(gib: u64, sm: u32) -> Ask {
        Ask { memory: gib * GIB, sm_percent: sm, compute_mode: ComputeMode::Strict }
    }

    #[test]
    fn every_record_counts_whoever_made_it() {
        let g = gpu(0, 80);
        let records = [
            // A kubelet's fixed share, a whole GPU elsewhere, a work-conserving share.
            record("k", vec![dev("GPU-0::1", "GPU-0", Some(20 * GIB), Some(25))]),
            record("w", vec![dev("GPU-1", "GPU-1", None, None)]),
            record("c", {
                let mut d = dev("GPU-0", "GPU-0", Some(10 * GIB), Some(50));
                d.compute_mode = ComputeMode::WorkConserving;
                vec![d]
            }),
        ];
        assert_eq!(held(&g, &records, None), Held { memory: 30 * GIB, strict_sm: 25 });
        assert_eq!(held(&g, &records, Some("k")), Held { memory: 10 * GIB, strict_sm: 0 });
        // A whole GPU leaves nothing.
        assert_eq!(held(&gpu(1, 80), &records, None).memory, 80 * GIB);
        assert!(fits(&g, held(&g, &records, None), ask(50, 75)));
        assert!(!fits(&g, held(&g, &records, None), ask(51, 10)), "memory past the GPU's");
        assert!(!fits(&g, held(&g, &records, None), ask(1, 76)), "strict SM past 100");
        let wc = Ask { compute_mode: ComputeMode::WorkConserving, ..ask(1, 90) };
        assert!(fits(&g, held(&g, &records, None), wc), "work-conserving percents are not summed");
        // No overflow on absurd asks.
        assert!(!fits(&g, held(&g, &records, None), Ask { memory: u64::MAX, ..ask(0, 1) }));
    }

    /// The store's sums give what a scan of the records gives, for any mix of parts (cases,
    /// unlimited, strict or not, absurd limits), with or without a record left out.
    #[test]
    fn held_from_the_loads_is_held_from_a_scan() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let gpus = [gpu(0, 80), gpu(1, 40), gpu(2, 80)];
        for round in 0..200 {
            let owned: Vec<Allocation> = (0..next(12))
                .map(|i| {
                    let parts = (0..1 + next(3))
                        .map(|_| {
                            let n = next(4);
                            let uuid = if next(2) == 0 { format!("GPU-{n}") } else { format!("gpu-{n}") };
                            let memory = match next(5) {
                                0 => None,
                                1 => Some(u64::MAX - next(3)),
                                _ => Some(next(40) * GIB),
                            };
                            let mut d = dev(
                                &format!("{uuid}::{i}"),
                                &uuid,
                                memory,
                                [None, Some(30), Some(100)][next(3) as usize],
                            );
                            if next(2) == 0 {
                                d.compute_mode = ComputeMode::WorkConserving;
                            }
                            d
                        })
                        .collect();
                    record(&format!("r{i}"), parts)
                })
                .collect();
            let records: Vec<&Allocation> = owned.iter().collect();
            let loads = Loads::of(owned.iter());
            for g in &gpus {
                assert_eq!(
                    held_in(g, &loads, None),
                    held(g, records.iter().copied(), None),
                    "round {round}, {}",
                    g.uuid
                );
                for a in &owned {
                    assert_eq!(
                        held_in(g, &loads, Some(a)),
                        held(g, records.iter().copied(), Some(&a.id)),
                        "round {round}, {} without {}",
                        g.uuid,
                        a.id
                    );
                }
            }
            let by_loads = place(&gpus, |g| held_in(g, &loads, None), "", ask(8, 30), Placement::Packed);
            assert_eq!(by_loads, place(&gpus, scan(&records), "", ask(8, 30), Placement::Packed), "round {round}");
        }
    }

    #[test]
    fn packed_takes_the_fullest_spread_the_emptiest() {
        let gpus = [gpu(0, 80), gpu(1, 80), gpu(2, 80)];
        let owned = [record("a", vec![dev("GPU-1", "GPU-1", Some(40 * GIB), Some(40))])];
        let records: Vec<&Allocation> = owned.iter().collect();
        assert_eq!(place(&gpus, scan(&records), "", ask(8, 30), Placement::Packed).unwrap().index, 1);
        assert_eq!(place(&gpus, scan(&records), "", ask(8, 30), Placement::Spread).unwrap().index, 0);
        // Too big for the fuller one: the next.
        assert_eq!(place(&gpus, scan(&records), "", ask(41, 30), Placement::Packed).unwrap().index, 0);
        assert_eq!(place(&gpus, scan(&records), "2", ask(8, 30), Placement::Packed).unwrap().index, 2);
        assert_eq!(place(&gpus, scan(&records), "gpu-2", ask(8, 30), Placement::Packed).unwrap().index, 2);
        assert_eq!(place(&gpus, scan(&records), "h100", ask(8, 30), Placement::Packed).unwrap().index, 1);
    }

    #[test]
    fn a_refusal_names_each_gpu_and_what_it_has_free() {
        let mut gpus = vec![gpu(0, 80), gpu(1, 40)];
        gpus[1].unavailable = Some("unhealthy: XID 79".into());
        let owned = [record("a", vec![dev("GPU-0", "GPU-0", Some(72 * GIB), Some(80))])];
        let records: Vec<&Allocation> = owned.iter().collect();
        let err = place(&gpus, scan(&records), "", ask(16, 30), Placement::Packed).unwrap_err();
        assert_eq!(
            err,
            "no GPU has room for 16 GiB and 30% SM (strict): GPU 0 (GPU-0): 8 GiB of 80 GiB free, 20% SM free; \
             GPU 1 (GPU-1): unhealthy: XID 79"
        );
        let err = place(&gpus, scan(&records), "7", ask(1, 1), Placement::Packed).unwrap_err();
        assert!(err.starts_with("gpu: no GPU \"7\""), "{err}");
        let err = place(&gpus, scan(&records), "A100", ask(1, 1), Placement::Packed).unwrap_err();
        assert!(err.starts_with("gpu: no GPU \"A100\""), "{err}");
    }

    #[test]
    fn whole_gpus_only_where_nothing_is_held() {
        let mut gpus = vec![gpu(0, 80), gpu(1, 80), gpu(2, 80), mig_gpu(3, &["3g.40gb"])];
        gpus[2].unavailable = Some("unhealthy: XID 79".into());
        // A work-conserving share of 1 GiB on GPU 0 is enough to keep it from being given whole.
        let owned = [record("s", {
            let mut d = dev("GPU-0", "GPU-0", Some(GIB), Some(10));
            d.compute_mode = ComputeMode::WorkConserving;
            vec![d]
        })];
        let records: Vec<&Allocation> = owned.iter().collect();
        let got = place_whole(&gpus, &records, "", 1).unwrap();
        assert_eq!(got.iter().map(|g| g.index).collect::<Vec<_>>(), [1]);
        let err = place_whole(&gpus, &records, "", 2).unwrap_err();
        assert_eq!(
            err,
            "2 whole GPUs asked, 1 free of the 4 named: GPU 0 (GPU-0): held by s (1 GiB of 80 GiB and 0% strict SM); \
             GPU 2 (GPU-2): unhealthy: XID 79; GPU 3 (GPU-3): MIG mode is on (ask for a MIG profile)"
        );
        assert!(place_whole(&gpus, &records, "0", 1).unwrap_err().contains("held by s"));
        // A GPU held whole leaves no room for a share: the rule shares are admitted by.
        let whole = [record("w", vec![dev("GPU-1", "GPU-1", None, None)])];
        let all: Vec<&Allocation> = owned.iter().chain(&whole).collect();
        assert!(
            place(&gpus, scan(&all), "1", ask(1, 1), Placement::Packed).unwrap_err().contains("0 MiB of 80 GiB free")
        );
        assert!(place_whole(&gpus, &all, "", 1).unwrap_err().starts_with("1 whole GPU asked, 0 free"));
    }

    #[test]
    fn sizes_for_people() {
        assert_eq!(
            (size(80 * GIB), size(512 << 20), size(1), size((3 << 20) / 2)),
            ("80 GiB".to_owned(), "512 MiB".to_owned(), "1 B".to_owned(), "1.5 MiB".to_owned())
        );
    }

    #[test]
    fn mig_devices_of_a_profile_free_or_named_with_their_holders() {
        let mut gpus = vec![gpu(0, 80), mig_gpu(1, &["3g.40gb", "3g.40gb"]), mig_gpu(2, &["1g.10gb"])];
        gpus[2].mig[0].unavailable = Some("unhealthy: XID 94".into());
        let owned = [record("m", vec![dev("MIG-1-0", "MIG-1-0", None, None)])];
        let records: Vec<&Allocation> = owned.iter().collect();
        let (g, m) = place_mig(&gpus, &records, "", "3g.40gb").unwrap();
        assert_eq!((g.index, m.uuid.as_str()), (1, "MIG-1-1"));
        // A share of a MIG device holds it too.
        let owned2 = [
            record("m", vec![dev("MIG-1-0", "MIG-1-0", None, None)]),
            record("s", vec![dev("MIG-1-1::0", "MIG-1-1", Some(GIB), Some(50))]),
        ];
        let records: Vec<&Allocation> = owned2.iter().collect();
        let err = place_mig(&gpus, &records, "", "3g.40gb").unwrap_err();
        assert_eq!(
            err,
            "no free MIG device of profile 3g.40gb: GPU 0 (GPU-0): MIG mode is off; \
             GPU 1 (GPU-1): MIG-1-0 held by m, MIG-1-1 held by s; GPU 2 (GPU-2): no 3g.40gb instance"
        );
        // A profile no instance has: the ones there are named; no GPU in MIG mode: how to make some.
        let err = place_mig(&gpus, &records, "", "2g.20gb").unwrap_err();
        assert!(err.ends_with(". The instances here are of the profiles: 1g.10gb, 3g.40gb"), "{err}");
        let err = place_mig(&gpus, &records, "0", "2g.20gb").unwrap_err();
        assert!(err.ends_with("`tessera layout apply --gpu <GPU> --mig 2g.20gb=<COUNT>` makes instances"), "{err}");
        // A profile no GPU has (a typo): said so, with the profiles there are; never "make some".
        let err = place_mig(&gpus, &records, "", "3g.4gb").unwrap_err();
        assert!(
            err.ends_with(". No GPU named has a MIG profile \"3g.4gb\"; they have: 1g.10gb, 2g.20gb, 3g.40gb, 7g.80gb"),
            "{err}"
        );
        gpus[0].mig_profiles.clear();
        let err = place_mig(&gpus, &records, "0", "3g.40gb").unwrap_err();
        assert!(err.ends_with(": GPU 0 (GPU-0): MIG mode is off. No GPU named supports MIG"), "{err}");
        let err = place_mig(&gpus, &records, "2", "1g.10gb").unwrap_err();
        assert!(err.contains("MIG-2-0 unhealthy: XID 94"), "{err}");
        // Shares are never carved from a GPU in MIG mode.
        assert!(
            place(&gpus, scan(&records), "1", ask(1, 1), Placement::Packed).unwrap_err().contains("MIG mode is on")
        );
    }
}
