//! The cluster in one process: real nodes (real stores, real openraft) over an in-process
//! network with partitions. Each test names what it proves.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use keel_catalog::{Command, MetadataError, NodeRole, NodeState, Outcome, FIRST_NODE_ID};
use keel_cluster::LocalNetwork;
use support::*;

const SETTLE: Duration = Duration::from_secs(15);

// Proves a lone node forms a one-node cluster, applies commands, and keeps them across a
// restart (the log, the vote and the applied state come back from its store).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_node_forms_and_survives_a_restart() {
    let network = LocalNetwork::new();
    let dir = node_dir("one_node", "a");
    let a = start(&network, dir.clone(), "a", Options::default()).await;
    assert_eq!(a.cluster.node_id(), FIRST_NODE_ID);
    let outcome = a
        .cluster
        .propose_async(volume_command("v1", FIRST_NODE_ID))
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Volume(_)));
    let refused = a
        .cluster
        .propose_async(volume_command("v1", FIRST_NODE_ID))
        .await;
    assert!(
        matches!(refused, Err(MetadataError::Refused(_))),
        "{refused:?}"
    );
    let cluster_id = a.cluster.identity().cluster_id;
    a.crash(&network).await;

    let a = start(&network, dir, "a", Options::default()).await;
    assert_eq!(a.cluster.identity().cluster_id, cluster_id);
    assert!(volume_names(&a).contains("v1"));
    a.cluster
        .propose_async(volume_command("v2", FIRST_NODE_ID))
        .await
        .unwrap();
    assert_eq!(volume_names(&a).len(), 2);
}

// Proves nodes join through any member, become voters once caught up, and that a proposal
// made on a follower is forwarded, applied everywhere, and visible on that follower when the
// call returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_form_and_forward_proposals() {
    let network = LocalNetwork::new();
    let a = start(&network, node_dir("three", "a"), "a", Options::default()).await;
    let b = start(
        &network,
        node_dir("three", "b"),
        "b",
        Options {
            join: Some(a.address.clone()),
            ..Options::default()
        },
    )
    .await;
    // c joins through b (not the leader): the join is forwarded.
    let c = start(
        &network,
        node_dir("three", "c"),
        "c",
        Options {
            join: Some(b.address.clone()),
            ..Options::default()
        },
    )
    .await;
    let ids: std::collections::BTreeSet<_> = [
        a.cluster.node_id(),
        b.cluster.node_id(),
        c.cluster.node_id(),
    ]
    .into();
    assert_eq!(ids.len(), 3, "distinct node ids");
    wait_for("three voters", SETTLE, || voters(&a) == ids).await;
    for i in 0..10 {
        c.cluster
            .propose_async(volume_command(&format!("v{i}"), a.cluster.node_id()))
            .await
            .unwrap();
        assert!(
            volume_names(&c).contains(&format!("v{i}")),
            "the proposer reads its own write"
        );
    }
    wait_for("every node applied everything", SETTLE, || {
        volume_names(&a).len() == 10 && volume_names(&b).len() == 10
    })
    .await;
    assert_eq!(*a.cluster.catalog().read(), *b.cluster.catalog().read());
    assert_eq!(*a.cluster.catalog().read(), *c.cluster.catalog().read());
}

// Proves a retried proposal (same id) is applied once and answered with its first outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_proposal_is_applied_once() {
    let network = LocalNetwork::new();
    let a = start(&network, node_dir("dedup", "a"), "a", Options::default()).await;
    let proposal = keel_cluster::messages::Proposal {
        id: [9; 16],
        command: volume_command("once", FIRST_NODE_ID),
    };
    let first = a
        .cluster
        .raft()
        .client_write(proposal.clone())
        .await
        .unwrap();
    let second = a.cluster.raft().client_write(proposal).await.unwrap();
    assert!(matches!(first.data.0, Ok(Outcome::Volume(_))));
    assert_eq!(
        first.data, second.data,
        "the repeat answers the first outcome, not 'already exists'"
    );
    assert_eq!(a.cluster.catalog().read().volumes.len(), 1);
}

async fn form_three(network: &LocalNetwork, test: &str) -> Vec<TestNode> {
    let a = start(network, node_dir(test, "a"), "a", Options::default()).await;
    let mut nodes = vec![a];
    for name in ["b", "c"] {
        let join = Some(nodes[0].address.clone());
        nodes.push(
            start(
                network,
                node_dir(test, name),
                name,
                Options {
                    join,
                    ..Options::default()
                },
            )
            .await,
        );
    }
    wait_for("three voters everywhere", SETTLE, || {
        formed(&nodes.iter().collect::<Vec<_>>())
    })
    .await;
    nodes
}

// Proves that after the leader crashes the others elect a new one, keep every acknowledged
// change, accept new ones, record the lost node as down, and that the old leader catches up
// when it comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_crash_keeps_acknowledged_changes() {
    let network = LocalNetwork::new();
    let mut nodes = form_three(&network, "leader_crash").await;
    for i in 0..5 {
        nodes[1]
            .cluster
            .propose_async(volume_command(&format!("before{i}"), FIRST_NODE_ID))
            .await
            .unwrap();
    }
    let leader_id = nodes[0].cluster.leader().unwrap();
    let index = nodes
        .iter()
        .position(|n| n.cluster.node_id() == leader_id)
        .unwrap();
    let leader = nodes.remove(index);
    let (dir, name, _) = leader.crash(&network).await;
    let started = tokio::time::Instant::now();
    wait_for("a new leader", SETTLE, || {
        nodes[0].cluster.leader().is_some_and(|id| id != leader_id)
    })
    .await;
    let elected_after = started.elapsed();
    assert!(elected_after < Duration::from_secs(5), "{elected_after:?}");
    for i in 0..5 {
        nodes[0]
            .cluster
            .propose_async(volume_command(&format!("after{i}"), FIRST_NODE_ID))
            .await
            .unwrap();
    }
    let survivors_see = volume_names(&nodes[0]);
    assert!((0..5).all(|i| survivors_see.contains(&format!("before{i}"))));
    wait_for("the crashed leader recorded down", SETTLE, || {
        nodes[0]
            .cluster
            .catalog()
            .read()
            .nodes
            .get(&leader_id)
            .is_some_and(|node| node.state == NodeState::Down)
    })
    .await;
    let back = start(&network, dir, &name, Options::default()).await;
    wait_for("the old leader catches up", SETTLE, || {
        volume_names(&back).len() == 10
    })
    .await;
    wait_for("and is up again", SETTLE, || {
        nodes[0]
            .cluster
            .catalog()
            .read()
            .nodes
            .get(&leader_id)
            .is_some_and(|node| node.state == NodeState::Up)
    })
    .await;
}

// Proves a minority side refuses metadata writes with a clear error while the majority goes
// on, and that after healing every node holds one history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_minority_refuses_writes_and_heals_into_one_history() {
    let network = LocalNetwork::new();
    let nodes = form_three(&network, "partition").await;
    let all: Vec<_> = nodes.iter().map(|n| n.cluster.node_id()).collect();
    let leader_id = nodes[0].cluster.leader().unwrap();
    let minority = nodes
        .iter()
        .find(|n| n.cluster.node_id() == leader_id)
        .unwrap();
    let majority: Vec<&TestNode> = nodes
        .iter()
        .filter(|n| n.cluster.node_id() != leader_id)
        .collect();
    network.partition(&[leader_id], &all);
    let refused = minority
        .cluster
        .propose_async(volume_command("minority", FIRST_NODE_ID))
        .await;
    match &refused {
        Err(MetadataError::Unavailable { detail }) | Err(MetadataError::Timeout { detail }) => {
            assert!(!detail.is_empty())
        }
        other => panic!("a minority write must fail, got {other:?}"),
    }
    // The majority elects a leader of its own first (the old one is on the other side).
    let deadline = tokio::time::Instant::now() + SETTLE;
    loop {
        match majority[0]
            .cluster
            .propose_async(volume_command("majority", FIRST_NODE_ID))
            .await
        {
            Ok(_) => break,
            // No leader known yet: nothing was proposed, so trying again cannot apply twice.
            Err(MetadataError::Unavailable { detail }) if detail.contains("no leader") => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the majority never elected a leader: {detail}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(other) => panic!("the majority refused a write: {other:?}"),
        }
    }
    network.heal();
    wait_for("one history", SETTLE, || {
        let names: Vec<_> = nodes.iter().map(volume_names).collect();
        names.iter().all(|n| n.contains("majority")) && names.windows(2).all(|w| w[0] == w[1])
    })
    .await;
    // The minority's failed write did not survive into the healed history (it never committed)
    // or, if its entry committed after healing, it is there on every node alike.
    let names = volume_names(&nodes[0]);
    assert!(nodes.iter().all(|n| volume_names(n) == names));
}

// Proves a node that was away while the log moved far past a snapshot catches up by snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_far_behind_node_catches_up_by_snapshot() {
    let network = LocalNetwork::new();
    let timing = keel_cluster::Timing {
        snapshot_every_entries: 20,
        ..fast_timing()
    };
    let a = start(
        &network,
        node_dir("snapshot", "a"),
        "a",
        Options {
            timing: timing.clone(),
            ..Options::default()
        },
    )
    .await;
    let mut others = Vec::new();
    for name in ["b", "c"] {
        others.push(
            start(
                &network,
                node_dir("snapshot", name),
                name,
                Options {
                    join: Some(a.address.clone()),
                    timing: timing.clone(),
                    ..Options::default()
                },
            )
            .await,
        );
    }
    wait_for("three voters", SETTLE, || voters(&a).len() == 3).await;
    let away = others.pop().unwrap();
    let away_id = away.cluster.node_id();
    let (dir, name, _) = away.crash(&network).await;
    for i in 0..120 {
        a.cluster
            .propose_async(volume_command(&format!("v{i}"), FIRST_NODE_ID))
            .await
            .unwrap();
    }
    wait_for("the leader purged its log", SETTLE, || {
        a.cluster.metrics().purged.is_some_and(|id| id.index() > 60)
    })
    .await;
    let back = start(
        &network,
        dir,
        &name,
        Options {
            timing,
            ..Options::default()
        },
    )
    .await;
    assert_eq!(back.cluster.node_id(), away_id);
    wait_for("caught up", SETTLE, || volume_names(&back).len() == 120).await;
    assert!(
        back.cluster.metrics().snapshot.is_some(),
        "it installed a snapshot (the entries it missed were purged)"
    );
}

// Proves two storage nodes and a witness survive the loss of either the witness or one data
// node for metadata, and that a lone survivor is blocked until force-primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_and_a_witness() {
    let network = LocalNetwork::new();
    let a = start(&network, node_dir("witness", "a"), "a", Options::default()).await;
    let b = start(
        &network,
        node_dir("witness", "b"),
        "b",
        Options {
            join: Some(a.address.clone()),
            ..Options::default()
        },
    )
    .await;
    let w = start(
        &network,
        node_dir("witness", "w"),
        "w",
        Options {
            join: Some(a.address.clone()),
            role: NodeRole::Witness,
            ..Options::default()
        },
    )
    .await;
    wait_for("three voters including the witness", SETTLE, || {
        formed(&[&a, &b, &w])
    })
    .await;
    let refused = a
        .cluster
        .propose_async(volume_command("on-witness", w.cluster.node_id()))
        .await;
    assert!(
        matches!(refused, Err(MetadataError::Refused(_))),
        "a witness holds no data: {refused:?}"
    );

    let (w_dir, _, _) = w.crash(&network).await;
    b.cluster
        .propose_async(volume_command("without-witness", FIRST_NODE_ID))
        .await
        .unwrap();
    let w = start(
        &network,
        w_dir,
        "w",
        Options {
            role: NodeRole::Witness,
            ..Options::default()
        },
    )
    .await;
    wait_for("the witness caught up", SETTLE, || {
        volume_names(&w).contains("without-witness")
    })
    .await;

    let (b_dir, _, _) = b.crash(&network).await;
    a.cluster
        .propose_async(volume_command("without-b", FIRST_NODE_ID))
        .await
        .unwrap();

    // Both others gone: the survivor cannot commit.
    let (_w_dir, _, _) = w.crash(&network).await;
    let blocked = a
        .cluster
        .propose_async(volume_command("alone", FIRST_NODE_ID))
        .await;
    assert!(blocked.is_err(), "{blocked:?}");
    let (a_dir, _, _) = a.crash(&network).await;
    let _ = b_dir;

    let store = keel_store::Store::open(keel_store::StoreConfig::new(vec![a_dir.clone()])).unwrap();
    let report = keel_cluster::force::force_primary(&store).unwrap();
    assert_eq!(report.previous_voters.len(), 3);
    drop(store);
    let a = start(&network, a_dir, "a", Options::default()).await;
    a.cluster
        .propose_async(volume_command("forced", FIRST_NODE_ID))
        .await
        .unwrap();
    let names = volume_names(&a);
    for name in ["without-witness", "without-b", "forced"] {
        assert!(names.contains(name), "{name} missing from {names:?}");
    }
    assert_eq!(voters(&a).len(), 1);
}

// Proves a node removed from the cluster leaves the Raft group and its id is not reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removed_nodes_leave_and_ids_are_never_reused() {
    let network = LocalNetwork::new();
    let nodes = form_three(&network, "remove").await;
    let leader = nodes
        .iter()
        .find(|n| n.cluster.is_leader())
        .expect("a leader");
    let victim = nodes
        .iter()
        .find(|n| !n.cluster.is_leader())
        .expect("a follower");
    let victim_id = victim.cluster.node_id();
    leader
        .cluster
        .propose_async(Command::NodeRemove { id: victim_id })
        .await
        .unwrap();
    wait_for("the removed node left raft", SETTLE, || {
        !leader
            .cluster
            .metrics()
            .membership_config
            .nodes()
            .any(|(id, _)| *id == victim_id)
    })
    .await;
    let d = start(
        &network,
        node_dir("remove", "d"),
        "d",
        Options {
            join: Some(leader.address.clone()),
            ..Options::default()
        },
    )
    .await;
    assert!(d.cluster.node_id() > 3, "fresh id {}", d.cluster.node_id());
}

/// How long a primary's lease lasts (keel-replication's `LEASE`).
const LEASE: Duration = Duration::from_secs(2);

// Proves a leader cut off from its quorum, together with a follower, renews nobody's lease: the
// follower reports to it (it still believes it leads) but the lease it gets runs from the
// leader's last quorum acknowledgement, so both lose their leases while the majority elects a
// leader of its own (which then hands their volumes to others). Without the cap, the follower
// kept a lease for as long as the partition lasted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_with_a_follower_renews_no_lease() {
    let network = LocalNetwork::new();
    let test = "stale_leader";
    let five = Options {
        voters: 5,
        ..Options::default()
    };
    let mut nodes = vec![start(&network, node_dir(test, "a"), "a", five).await];
    for name in ["b", "c", "d", "e"] {
        let join = Some(nodes[0].address.clone());
        let options = Options {
            join,
            voters: 5,
            ..Options::default()
        };
        nodes.push(start(&network, node_dir(test, name), name, options).await);
    }
    let all: Vec<_> = nodes.iter().map(|n| n.cluster.node_id()).collect();
    // Formed, not merely five voters listed: in the joint configuration ({a, b, c}, {a..e}) a
    // majority side without two of a, b and c can elect nobody.
    wait_for("five voters everywhere", SETTLE, || {
        formed(&nodes.iter().collect::<Vec<_>>())
    })
    .await;
    let leader_id = nodes[0].cluster.leader().unwrap();
    let leader = nodes
        .iter()
        .find(|n| n.cluster.node_id() == leader_id)
        .unwrap();
    let follower = nodes
        .iter()
        .find(|n| n.cluster.node_id() != leader_id)
        .unwrap();
    wait_for("the follower holds a lease", SETTLE, || {
        follower.cluster.holds_lease(LEASE)
    })
    .await;
    let minority = [leader_id, follower.cluster.node_id()];
    network.partition(&minority, &all);
    let cut_at = tokio::time::Instant::now();
    let majority: Vec<&TestNode> = nodes
        .iter()
        .filter(|n| !minority.contains(&n.cluster.node_id()))
        .collect();
    wait_for("a leader on the majority side", SETTLE, || {
        majority[0]
            .cluster
            .leader()
            .is_some_and(|id| !minority.contains(&id))
    })
    .await;
    tokio::time::sleep_until(cut_at + LEASE + Duration::from_millis(300)).await;
    assert_eq!(
        follower.cluster.leader(),
        Some(leader_id),
        "the follower must still report to the cut-off leader for this test to mean anything"
    );
    assert!(
        !leader.cluster.holds_lease(LEASE),
        "the cut-off leader kept its lease"
    );
    assert!(
        !follower.cluster.holds_lease(LEASE),
        "the cut-off leader renewed its follower's lease"
    );
    network.heal();
}

// Proves a new leader gives no lease before an entry of its own term is committed: until then
// it does not know how far the earlier leader committed (openraft's cluster-committed index
// starts afresh with each term), and a node back from a partition would get a lease while its
// catalog still said what it said before the cut. Here c was cut off while the others committed
// changes, then the leader died, and b, elected with c's vote, cannot commit its first entry
// (c needs a snapshot, which is held): c reports to b and is acknowledged, and neither holds a
// lease until the snapshot goes through. Found by simulation seed 80775, where such a c believed
// itself a volume's primary and served reads from its old copy; without the fix, b answered
// with "committed through 0" and c held a lease at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_gives_no_lease_before_its_own_term_committed() {
    let network = LocalNetwork::new();
    let test = "lease_new_term";
    // Snapshots every 10 entries, keeping 5: b purges what c lacks.
    let options = |join: Option<String>| Options {
        join,
        timing: keel_cluster::Timing {
            snapshot_every_entries: 10,
            ..fast_timing()
        },
        ..Options::default()
    };
    let mut nodes = vec![start(&network, node_dir(test, "a"), "a", options(None)).await];
    for name in ["b", "c"] {
        let join = Some(nodes[0].address.clone());
        nodes.push(start(&network, node_dir(test, name), name, options(join)).await);
    }
    wait_for("three voters everywhere", SETTLE, || {
        formed(&nodes.iter().collect::<Vec<_>>())
    })
    .await;
    let all: Vec<_> = nodes.iter().map(|n| n.cluster.node_id()).collect();
    let leader_id = nodes[0].cluster.leader().unwrap();
    let leader = nodes.remove(
        nodes
            .iter()
            .position(|n| n.cluster.node_id() == leader_id)
            .unwrap(),
    );
    let (b, c) = (&nodes[0], &nodes[1]);
    let (b_id, c_id) = (b.cluster.node_id(), c.cluster.node_id());
    wait_for("c holds a lease", SETTLE, || c.cluster.holds_lease(LEASE)).await;

    network.partition(&[c_id], &all);
    for index in 0..40 {
        (leader.cluster)
            .propose_async(volume_command(
                &format!("while-c-was-away-{index}"),
                leader_id,
            ))
            .await
            .unwrap();
    }
    let committed = leader.cluster.applied_index();
    wait_for("b applied the leader's changes", SETTLE, || {
        b.cluster.applied_index() >= committed
    })
    .await;
    let c_applied = c.cluster.applied_index();
    assert!(
        c_applied < committed,
        "c applied {c_applied} of {committed}"
    );
    wait_for("c's lease ran out", SETTLE, || {
        !c.cluster.holds_lease(LEASE)
    })
    .await;

    network.hold(c_id, keel_cluster::messages::METHOD_RAFT_SNAPSHOT);
    leader.crash(&network).await;
    let crashed = tokio::time::Instant::now();
    network.heal();
    wait_for("b leads, and c knows it", SETTLE, || {
        b.cluster.is_leader() && c.cluster.leader() == Some(b_id)
    })
    .await;
    // Several of c's reports, each answered (b's heartbeats reach c, which acknowledges them
    // with a conflict): a lease, if b gave one, would show by now. b's own lease, given by
    // the dead leader, runs out too.
    let watched = tokio::time::Instant::now();
    while watched.elapsed() < Duration::from_millis(1000) || crashed.elapsed() < LEASE * 2 {
        assert!(
            !c.cluster.holds_lease(LEASE),
            "c holds a lease with {} of {committed} entries applied",
            c.cluster.applied_index()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        !b.cluster.holds_lease(LEASE),
        "b holds a lease before its term committed"
    );
    assert!(
        network.calls_held(c_id, keel_cluster::messages::METHOD_RAFT_SNAPSHOT) > 0,
        "b never needed to send c a snapshot: the test proves nothing"
    );
    assert!(b.cluster.is_leader(), "b stopped leading");

    network.release_calls(c_id, keel_cluster::messages::METHOD_RAFT_SNAPSHOT);
    wait_for("c holds a lease again", SETTLE, || {
        c.cluster.holds_lease(LEASE)
    })
    .await;
    assert!(
        c.cluster.applied_index() >= committed,
        "c holds a lease with {} of {committed} entries applied",
        c.cluster.applied_index()
    );
    assert!(volume_names(c).contains("while-c-was-away-39"));
}

// Proves a leader elected after its predecessor died counts that leader's silence from the
// predecessor's last contact with the voters that elected it, not from its own election: a
// volume whose primary was the old leader is taken over a lease after the death rather than a
// lease after the election (which itself waits for the voters' own Raft leases to run out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_counts_the_old_leaders_silence_from_its_death() {
    let network = LocalNetwork::new();
    let mut nodes = form_three(&network, "old_leader_silence").await;
    let all: Vec<_> = nodes.iter().map(|n| n.cluster.node_id()).collect();
    let leader_id = nodes[0].cluster.leader().unwrap();
    let index = nodes
        .iter()
        .position(|n| n.cluster.node_id() == leader_id)
        .unwrap();
    let leader = nodes.remove(index);
    // Dead to the others from here (cut off both ways, as a crash is).
    network.partition(&[leader_id], &all);
    let died = tokio::time::Instant::now();
    let (silence, since_death) = loop {
        assert!(died.elapsed() < SETTLE, "no new leader with a quorum");
        let new_leader = nodes
            .iter()
            .find(|n| n.cluster.leader() == Some(n.cluster.node_id()));
        if let Some(new_leader) = new_leader {
            if let Ok(silence) = new_leader.cluster.silent_for(leader_id).await {
                break (silence, died.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // The election alone takes the voters' Raft lease (600 ms here) after the death.
    assert!(
        since_death >= Duration::from_millis(600),
        "elected {since_death:?} after the death"
    );
    assert!(
        silence + Duration::from_millis(200) >= since_death,
        "the old leader's silence counted {silence:?} where it died {since_death:?} ago"
    );
    network.heal();
    leader.crash(&network).await;
}

// Proves the status says a change of voters is under way for as long as Raft holds the joint
// configuration, and stops saying so once it ends: a change that cannot reach a majority of the
// new voters stays joint (here the leader reaches one other voter only), and the status is how
// an operator, or a test about to cut nodes off, knows that losing a node of either set now
// stalls the metadata.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_voter_change_under_way_is_reported_until_it_ends() {
    let network = LocalNetwork::new();
    let test = "voters_changing";
    let mut nodes = form_three(&network, test).await;
    let join = Some(nodes[0].address.clone());
    let options = Options {
        join,
        ..Options::default()
    };
    nodes.push(start(&network, node_dir(test, "d"), "d", options).await);
    let all: Vec<_> = nodes.iter().map(|n| n.cluster.node_id()).collect();
    let d = all[3];
    // On d too: until it has replicated the log up to its own addition, its membership is an
    // earlier one (the joint configuration that formed the three).
    wait_for("d a learner everywhere", SETTLE, || {
        nodes.iter().all(|n| {
            n.cluster
                .metrics()
                .membership_config
                .membership()
                .learner_ids()
                .any(|id| id == d)
        })
    })
    .await;
    for node in &nodes {
        assert!(!node.cluster.status().await.membership_changing);
    }
    let leader_id = nodes[0].cluster.leader().unwrap();
    let leader = nodes
        .iter()
        .find(|n| n.cluster.node_id() == leader_id)
        .unwrap();
    let follower = nodes[..3]
        .iter()
        .find(|n| n.cluster.node_id() != leader_id)
        .unwrap();
    network.partition(&[leader_id, follower.cluster.node_id()], &all);
    // {a, b, c} → {a, b, c, d}: the joint configuration needs 3 of the 4, and the leader's side
    // has 2.
    let raft = leader.cluster.raft().clone();
    let four: std::collections::BTreeSet<_> = all.iter().copied().collect();
    let change = tokio::spawn(async move {
        raft.change_membership(openraft::ChangeMembers::ReplaceAllVoters(four), true)
            .await
    });
    let deadline = tokio::time::Instant::now() + SETTLE;
    while !leader.cluster.status().await.membership_changing {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the leader never reported the change under way"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    network.heal();
    let deadline = tokio::time::Instant::now() + SETTLE;
    loop {
        let mut changing = false;
        for node in &nodes {
            changing |= node.cluster.status().await.membership_changing;
        }
        if !changing {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "a node still reports the change under way after healing"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    change.abort();
}

// Proves a proposal whose answer is lost is reported as perhaps made (a timeout), never as
// not made: the leader made it, the answers to the proposing follower are lost, and the
// follower says it timed out, also when its Raft is shut down while it retries (a caller told
// "unavailable" takes the change as never made, and may act on that).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proposal_whose_answer_is_lost_is_reported_as_perhaps_made() {
    let network = LocalNetwork::new();
    let nodes = form_three(&network, "answer_lost").await;
    let leader = nodes[0].cluster.leader().unwrap();
    let follower = nodes
        .iter()
        .find(|n| n.cluster.node_id() != leader)
        .unwrap();
    let leading = nodes
        .iter()
        .find(|n| n.cluster.node_id() == leader)
        .unwrap();
    network.lose_answers(
        follower.cluster.node_id(),
        keel_cluster::messages::METHOD_PROPOSE,
    );

    let outcome = follower
        .cluster
        .propose_async(volume_command("timed-out", leader))
        .await;
    assert!(
        matches!(outcome, Err(MetadataError::Timeout { .. })),
        "{outcome:?}"
    );
    assert!(volume_names(leading).contains("timed-out"));

    let cluster = follower.cluster.clone();
    let proposing = tokio::spawn(async move {
        cluster
            .propose_async(volume_command("shut-down", leader))
            .await
    });
    wait_for("the leader to make the change", SETTLE, || {
        volume_names(leading).contains("shut-down")
    })
    .await;
    follower.cluster.shutdown().await;
    let outcome = proposing.await.unwrap();
    assert!(
        matches!(outcome, Err(MetadataError::Timeout { .. })),
        "{outcome:?}"
    );
    for node in &nodes {
        node.cluster.shutdown().await;
    }
}
