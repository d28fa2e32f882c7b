//! The controller's one published offer carries what the allocation records hold: every change
//! of it, through any way in, is published again (`NodeController::follow_records`), so the
//! device plugin's withdrawn devices follow the kubelet's own changes too, with no second channel
//! and no timer. In-process, over a simulated node (in a child process of its own).

use std::sync::Arc;
use std::time::Duration;

use tessera_daemon::allocator::kubelet::Allocator;
use tessera_daemon::allocator::{DeviceAsk, ShareRequest};
use tessera_daemon::config::Config;
use tessera_daemon::node::{ConfigSource, NodeController};
use tessera_daemon::state::{Lease, Source};
use tessera_daemon::view::View;
use tessera_sim_testkit::SimNode;
use tokio::sync::watch;

mod common;

const ONE_H100: &str = "numa_nodes = 1
[[gpu]]
model = \"H100-SXM5-80GB\"
count = 1
";

const SHARE: &str = "tessera.io/gpu-share";

/// The next offer published, and the withdrawn devices' ids in it.
async fn next_offer(offers: &mut watch::Receiver<Arc<View>>) -> (Arc<View>, Vec<String>) {
    tokio::time::timeout(Duration::from_secs(10), offers.changed())
        .await
        .expect("an offer published within 10 s")
        .expect("the controller publishes");
    let view = offers.borrow_and_update().clone();
    let withdrawn = view.withdrawn_from_kubelet().into_iter().map(|(r, id)| format!("{r} {id}")).collect();
    (view, withdrawn)
}

/// GPU 0 in four shares of 20 GiB / 25 %. A pod holds the last; the node API carves 2 GiB and
/// 10 %: the third no longer fits and is withdrawn. The kubelet's record released (no node API
/// change at all), the offer is published again, and now the fourth is the one withdrawn; the
/// carved share released, nothing is. A change that holds nothing new (a container named)
/// publishes nothing.
#[test]
fn the_offer_is_published_again_on_every_change_of_what_the_records_hold() {
    let node = SimNode::with_description(ONE_H100);
    node.run_isolated("the_offer_is_published_again_on_every_change_of_what_the_records_hold", || {
        let tmp = tempfile::tempdir().expect("tempdir");
        let path = common::write_config(&node, tmp.path(), "[partitions.\"0\"]\nshares = { count = 4 }\n");
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("rt");
        runtime.block_on(async {
            let cfg = Config::load(&path, true).expect("config");
            std::fs::create_dir_all(&cfg.state_dir).expect("state dir");
            let session =
                tessera_daemon::discovery::Session::open(cfg.nvml_library.as_deref(), false).expect("session");
            let store = tessera_daemon::state::Store::open(&cfg.state_dir).expect("store");
            let events = Arc::new(tessera_daemon::events::EventBus::new(10, None));
            let source = ConfigSource { path: path.clone(), explicit: true };
            let (controller, _) = NodeController::start(session, cfg, source, store, events).expect("controller");
            let controller = Arc::new(controller);
            let (stop_tx, stop_rx) = watch::channel(false);
            let mut offers = controller.watch_offer();
            let follower = controller.follow_records(stop_rx);
            let shares: Vec<String> =
                offers.borrow_and_update().resources.resources[SHARE].devices.iter().map(|d| d.id.clone()).collect();
            assert_eq!(shares.len(), 4, "{shares:?}");
            let allocator = Arc::clone(controller.allocator());

            // The pod's share: published, nothing withdrawn.
            allocator.allocate(SHARE, &[shares[3].clone()]).expect("the kubelet's Allocate");
            let (view, withdrawn) = next_offer(&mut offers).await;
            assert!(view.holdings.kubelet_holds(SHARE, &shares[3]));
            assert!(withdrawn.is_empty(), "{withdrawn:?}");
            // Naming its container holds nothing new: nothing published.
            let pod = controller.allocations().into_iter().find(|a| a.source == Source::Kubelet).expect("pod");
            let named =
                tessera_daemon::state::ContainerIdentity { pod_name: Some("pod-a".into()), ..Default::default() };
            assert!(allocator.set_container(&pod.id, named).expect("named"));

            // The node API carves 2 GiB and 10%: the third share no longer fits.
            let carve = ShareRequest {
                device: DeviceAsk::Share,
                memory: 2 << 30,
                sm_percent: 10,
                priority: None,
                compute_mode: None,
                gpu: "0".into(),
                owner: Some("fn-a".into()),
                lease: Lease::None,
                preemptible: false,
            };
            let carved = allocator.allocate_share(&carve, &controller.gpu_rooms()).expect("carved");
            let (_, withdrawn) = next_offer(&mut offers).await;
            assert_eq!(withdrawn, [format!("{SHARE} {}", shares[2])], "the container's naming was not published");

            // The kubelet's own record released: published, the fourth is now the one withdrawn.
            assert!(allocator.release_unclaimed(&pod.id, Duration::ZERO).expect("released"));
            let (view, withdrawn) = next_offer(&mut offers).await;
            assert!(!view.holdings.kubelet_holds(SHARE, &shares[3]));
            assert_eq!(withdrawn, [format!("{SHARE} {}", shares[3])]);

            // The carved share released: everything fits again.
            assert!(allocator.release(&carved.id).expect("released"));
            let (view, withdrawn) = next_offer(&mut offers).await;
            assert!(withdrawn.is_empty(), "{withdrawn:?}");
            assert!(view.holdings.devices.is_empty(), "{:?}", view.holdings);

            stop_tx.send_replace(true);
            follower.await.expect("the follower stops");
        });
        tessera_daemon::state::mount::detach_all_under(tmp.path());
    });
}
