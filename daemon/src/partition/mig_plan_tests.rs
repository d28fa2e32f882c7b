use std::collections::{BTreeMap, BTreeSet};

use super::*;
use crate::discovery::{GiProfile, MigCapability, MigDevice, MigInfo, MigInstance};

/// The H100 SXM5 80GB table (`nvidia-smi mig -lgip` / `-lgipp`).
fn h100() -> MigCapability {
    let p = |name: &str, id, nvml_profile, slices, count, mib, size, starts: &[u32]| GiProfile {
        name: name.into(),
        id,
        nvml_profile,
        slice_count: slices,
        instance_count: count,
        memory_mib: mib,
        multiprocessors: 16 * slices,
        placement_size: size,
        placements: starts.to_vec(),
    };
    MigCapability {
        profiles: vec![
            p("1g.10gb", 19, 0, 1, 7, 9_984, 1, &[0, 1, 2, 3, 4, 5, 6]),
            p("1g.10gb+me", 20, 7, 1, 1, 9_984, 1, &[0, 1, 2, 3, 4, 5, 6]),
            p("1g.20gb", 15, 9, 1, 4, 20_096, 2, &[0, 2, 4, 6]),
            p("2g.20gb", 14, 1, 2, 3, 20_096, 2, &[0, 2, 4]),
            p("3g.40gb", 9, 2, 3, 2, 40_448, 4, &[0, 4]),
            p("4g.40gb", 5, 3, 4, 1, 40_448, 4, &[0]),
            p("7g.80gb", 0, 4, 7, 1, 81_152, 8, &[0]),
        ],
        compute_slices: 7,
    }
}

fn gi(cap: &MigCapability, gi_id: u32, profile: &str, start: u32, pids: &[u32]) -> MigInstance {
    let p = cap.profile(profile).unwrap();
    MigInstance {
        gi_id,
        profile: profile.into(),
        profile_id: p.id,
        start,
        size: p.placement_size,
        devices: vec![MigDevice {
            uuid: format!("MIG-{gi_id}"),
            gi_id,
            ci_id: 0,
            memory_total: p.memory_mib << 20,
            processes: pids.to_vec(),
        }],
    }
}

fn on(instances: Vec<MigInstance>) -> MigInfo {
    MigInfo { current: true, pending: true, switches_in_place: true, capability: h100(), instances }
}

fn want(list: &[(&str, u32)]) -> BTreeMap<String, u32> {
    list.iter().map(|(p, c)| (p.to_string(), *c)).collect()
}

fn none() -> BTreeSet<String> {
    BTreeSet::new()
}

fn creates(plan: &MigPlan) -> Vec<(String, u32)> {
    plan.actions
        .iter()
        .filter_map(|a| match a {
            MigAction::CreateInstance { profile, start, .. } => Some((profile.clone(), *start)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_matching_gpu_needs_nothing() {
    let cap = h100();
    let mig = on(vec![gi(&cap, 1, "4g.40gb", 0, &[]), gi(&cap, 2, "3g.40gb", 4, &[])]);
    let w = want(&[("3g.40gb", 1), ("4g.40gb", 1)]);
    let p = plan(Desired::On(&w), Some(&mig), &none(), &[]).unwrap();
    assert!(p.is_noop(), "{p:?}");
    let off =
        MigInfo { current: false, pending: false, switches_in_place: true, capability: h100(), instances: vec![] };
    assert!(plan(Desired::Off, Some(&off), &none(), &[]).unwrap().is_noop());
    assert!(plan(Desired::Off, None, &none(), &[]).unwrap().is_noop());
}

#[test]
fn four_and_three_fit_only_with_the_four_first() {
    // A 3g created first takes slices 0-3 (first fit), where the 4g has its only placement.
    let w = want(&[("3g.40gb", 1), ("4g.40gb", 1)]);
    let p = plan(Desired::On(&w), Some(&on(vec![])), &none(), &[]).unwrap();
    let mut c = creates(&p);
    c.sort();
    assert_eq!(c, vec![("3g.40gb".to_string(), 4), ("4g.40gb".to_string(), 0)]);
    // A free 3g at 0 is moved out of the way rather than failing.
    let cap = h100();
    let p = plan(Desired::On(&w), Some(&on(vec![gi(&cap, 1, "3g.40gb", 0, &[])])), &none(), &[]).unwrap();
    assert_eq!(p.actions[0], MigAction::DestroyInstance { gi_id: 1, profile: "3g.40gb".into() });
    assert_eq!(creates(&p).len(), 2);
    // A free 3g at 4 is kept.
    let p = plan(Desired::On(&w), Some(&on(vec![gi(&cap, 1, "3g.40gb", 4, &[])])), &none(), &[]).unwrap();
    assert_eq!(creates(&p), vec![("4g.40gb".to_string(), 0)]);
}

#[test]
fn mixed_layouts_search_every_placement() {
    // 1g.20gb takes two memory slices at even starts; 2g.20gb at 0, 2, 4; 1g.10gb anywhere.
    let w = want(&[("2g.20gb", 2), ("1g.20gb", 1), ("1g.10gb", 1)]);
    let p = plan(Desired::On(&w), Some(&on(vec![])), &none(), &[]).unwrap();
    assert_eq!(creates(&p).len(), 4, "{p:?}");
    let w = want(&[("1g.10gb", 7)]);
    assert_eq!(creates(&plan(Desired::On(&w), Some(&on(vec![])), &none(), &[]).unwrap()).len(), 7);
    let w = want(&[("4g.40gb", 1), ("7g.80gb", 1)]);
    assert!(matches!(plan(Desired::On(&w), Some(&on(vec![])), &none(), &[]), Err(PlanError::NoFit { .. })));
}

#[test]
fn instances_in_use_are_never_destroyed() {
    let cap = h100();
    let busy = vec![gi(&cap, 1, "3g.40gb", 0, &[4242])];
    // Not in the new layout: refused.
    let w = want(&[("1g.10gb", 7)]);
    let e = plan(Desired::On(&w), Some(&on(busy.clone())), &none(), &[]).unwrap_err();
    assert!(matches!(e, PlanError::InUse { gi_id: 1, .. }), "{e}");
    // In the layout but where the rest cannot fit around it: refused, no destroy.
    let w = want(&[("3g.40gb", 1), ("4g.40gb", 1)]);
    let e = plan(Desired::On(&w), Some(&on(busy.clone())), &none(), &[]).unwrap_err();
    assert!(matches!(&e, PlanError::NoFit { kept, .. } if kept == &vec!["3g.40gb at 0".to_string()]), "{e}");
    // Kept, the rest placed around it.
    let w = want(&[("3g.40gb", 1), ("1g.10gb", 3)]);
    let p = plan(Desired::On(&w), Some(&on(busy.clone())), &none(), &[]).unwrap();
    assert!(creates(&p).iter().all(|(_, s)| *s >= 4), "{p:?}");
    assert!(!p.actions.iter().any(|a| matches!(a, MigAction::DestroyInstance { .. })));
    // Held by an allocation, no process: the same.
    let held: BTreeSet<String> = ["MIG-1".to_string()].into();
    let w = want(&[("1g.10gb", 7)]);
    let e = plan(Desired::On(&w), Some(&on(vec![gi(&cap, 1, "3g.40gb", 0, &[])])), &held, &[]).unwrap_err();
    assert!(e.to_string().contains("allocated"), "{e}");
    // Turning MIG off with an instance in use: refused.
    assert!(matches!(plan(Desired::Off, Some(&on(busy)), &none(), &[]), Err(PlanError::InUse { .. })));
}

#[test]
fn mode_changes_pend_until_a_reset() {
    let w = want(&[("1g.10gb", 2)]);
    let off =
        MigInfo { current: false, pending: false, switches_in_place: true, capability: h100(), instances: vec![] };
    let p = plan(Desired::On(&w), Some(&off), &none(), &[]).unwrap();
    assert_eq!(p.actions, vec![MigAction::SetMode { enable: true }]);
    assert!(p.pending_reset);
    let asked = MigInfo { pending: true, ..off.clone() };
    let p = plan(Desired::On(&w), Some(&asked), &none(), &[]).unwrap();
    assert!(p.actions.is_empty() && p.pending_reset, "asked once, then only reported");
    assert!(matches!(plan(Desired::On(&w), Some(&off), &none(), &[7]), Err(PlanError::GpuInUse { .. })));
    // Off: free instances destroyed, then the mode asked off.
    let cap = h100();
    let p = plan(Desired::Off, Some(&on(vec![gi(&cap, 3, "7g.80gb", 0, &[])])), &none(), &[]).unwrap();
    assert_eq!(
        p.actions,
        vec![MigAction::DestroyInstance { gi_id: 3, profile: "7g.80gb".into() }, MigAction::SetMode { enable: false }]
    );
    assert!(p.pending_reset);
}

#[test]
fn unknown_profiles_and_no_mig_are_errors() {
    let w = want(&[("2g.99gb", 1)]);
    let e = plan(Desired::On(&w), Some(&on(vec![])), &none(), &[]).unwrap_err();
    assert!(
        matches!(&e, PlanError::UnknownProfile { profile, available } if profile == "2g.99gb" && available.len() == 7)
    );
    assert_eq!(plan(Desired::On(&w), None, &none(), &[]), Err(PlanError::NotSupported));
}

#[test]
fn a_kept_instance_without_compute_instance_gets_one() {
    let cap = h100();
    let mut bare = gi(&cap, 1, "7g.80gb", 0, &[]);
    bare.devices.clear();
    let w = want(&[("7g.80gb", 1)]);
    let p = plan(Desired::On(&w), Some(&on(vec![bare])), &none(), &[]).unwrap();
    assert_eq!(p.actions, vec![MigAction::CreateComputeInstance { gi_id: 1, profile: "7g.80gb".into() }]);
}

#[test]
fn an_unknown_profile_on_a_driver_that_lists_none_says_so() {
    let e = PlanError::UnknownProfile { profile: "1g.10gb".into(), available: vec![] }.to_string();
    assert!(e.ends_with("its driver lists no MIG profiles"), "{e}");
    let e = PlanError::UnknownProfile { profile: "9g".into(), available: vec!["1g.10gb".into()] }.to_string();
    assert!(e.ends_with("it has 1g.10gb"), "{e}");
}
