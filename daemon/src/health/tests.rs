use super::*;

#[test]
fn reset_evidence() {
    let c = |u, k, p| Counters { ecc_uncorrected: u, ecc_corrected: k, remap_pending: p, recovery_action: None };
    let action = |a| Counters { recovery_action: a, ..Counters::default() };
    assert!(reset_seen(&action(Some(1)), &action(Some(0))).is_some(), "GPU_RESET cleared");
    assert!(reset_seen(&action(Some(4)), &action(Some(0))).is_some(), "DRAIN_AND_RESET cleared");
    assert_eq!(reset_seen(&action(Some(1)), &action(Some(1))), None, "still asks for a reset");
    assert_eq!(reset_seen(&action(Some(2)), &action(Some(0))), None, "a reboot is not seen from here");
    assert_eq!(reset_seen(&action(Some(1)), &action(None)), None, "unknown is not evidence");
    assert_eq!(reset_seen(&c(Some(2), Some(0), None), &c(Some(2), Some(0), None)), None);
    assert!(reset_seen(&c(Some(2), Some(0), None), &c(Some(0), Some(0), None)).is_some());
    assert!(reset_seen(&c(Some(0), Some(5), None), &c(Some(0), Some(0), None)).is_some());
    assert!(reset_seen(&c(None, None, Some(true)), &c(None, None, Some(false))).is_some());
    assert_eq!(reset_seen(&c(Some(0), Some(0), Some(false)), &c(Some(0), Some(0), Some(false))), None);
    assert_eq!(reset_seen(&c(Some(1), None, None), &c(None, None, None)), None, "unknown is not evidence");
}

#[test]
fn outage_health() {
    let mut o = Outage {
        fault: api::FaultKind::Xid,
        xid: Some(48),
        reason: "XID 48".into(),
        since: Instant::now(),
        lost: false,
        baseline: Counters::default(),
        check: None,
        reported: Instant::now(),
        repeats: 0,
    };
    assert_eq!((o.health(), o.describe().as_str()), (api::Health::Unhealthy, "unhealthy: XID 48"));
    o.lost = true;
    assert_eq!(o.health(), api::Health::Lost);
    o.check = Some(Check { since: Instant::now(), probes: 1, how: "reset" });
    assert_eq!(o.health(), api::Health::Recovering);
}

#[test]
fn health_keys_are_validated() {
    use crate::config::Config;
    let c = Config::parse("[health]\nfatal_xids = [13]\nignored_xids = [31]\nrecovery_check_ms = 0\n").unwrap();
    assert_eq!((c.health.fatal_xids, c.health.recovery_check_ms), (vec![13], 0));
    assert_eq!(Config::default().health.recovery_check_ms, 10_000);
    let e = Config::parse("[health]\nfatal_xids = [13]\n").unwrap_err();
    assert_eq!(e.key, "health.fatal_xids", "13 is in the default ignored_xids");
    let e = Config::parse("[health]\nrecovery_check_ms = 3600001\n").unwrap_err();
    assert_eq!(e.key, "health.recovery_check_ms");
}

#[test]
fn attribution_text() {
    assert_eq!(attributed(&[]), "");
    let h = api::Holder {
        allocation_id: "a1".into(),
        container: Some(api::ContainerIdentity {
            pod_namespace: "ns".into(),
            pod_name: "p".into(),
            container_name: "c".into(),
            ..Default::default()
        }),
    };
    let bare = api::Holder { allocation_id: "a2".into(), container: None };
    assert_eq!(attributed(&[h, bare]), ": attributed to a1 (ns/p/c), a2");
}
