//! Which GPU a process uses: its local rank among the ranks on its host, modulo the devices it
//! sees.
//!
//! torchrun, SLURM, OpenMPI and our launcher say the local rank. A Kubeflow PyTorchJob, or a job
//! started with plain `RANK`/`WORLD_SIZE`, does not; then the ranks publish their host names in
//! the store and each counts the ranks before it on the same host. With one device per process
//! (`srun --gpus-per-task=1`, or `CUDA_VISIBLE_DEVICES` set per rank) every process sees device
//! 0 only, so the device is the local rank modulo the visible devices.

use crate::error::Result;
use crate::rendezvous::store::Store;
use crate::rendezvous::world::World;
use std::time::Duration;

const HOST_KEY: &str = "burn-dist/host/";

/// Whether the environment gives ranks without local ranks (torchrun-style `RANK` without
/// `LOCAL_RANK`): then [`World::from_env`] guessed and the store must settle it.
pub fn local_rank_missing(get: &dyn Fn(&str) -> Option<String>) -> bool {
    get("RANK").is_some() && get("LOCAL_RANK").is_none()
}

/// `(local rank, local world size)` of `rank` when rank `i` runs on `hosts[i]`.
pub fn local_from_hosts(hosts: &[String], rank: usize) -> (usize, usize) {
    let mine = &hosts[rank];
    let before = hosts[..rank].iter().filter(|h| *h == mine).count();
    let same = hosts.iter().filter(|h| *h == mine).count();
    (before, same)
}

/// The CUDA device of a process with `local_rank` that sees `visible` devices.
pub fn device_for(local_rank: usize, visible: usize) -> usize {
    if visible == 0 {
        0
    } else {
        local_rank % visible
    }
}

/// This machine's host name (`gethostname`).
pub fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it or
    // truncates, and we read up to the first NUL only.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if r != 0 {
        return "localhost".into();
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Publishes `host` for this rank, waits for every rank's, and returns `world` with the local
/// rank and local world size they imply.
///
/// # Errors
/// Store errors, or a timeout naming the rank whose host never arrived.
pub fn settle_through_store(
    world: &World,
    store: &Store,
    host: &str,
    timeout: Duration,
) -> Result<World> {
    store.set(&format!("{HOST_KEY}{}", world.rank), host.as_bytes())?;
    let mut hosts = Vec::with_capacity(world.world_size);
    for rank in 0..world.world_size {
        let value = store.get(&format!("{HOST_KEY}{rank}"), timeout)?;
        hosts.push(String::from_utf8_lossy(&value).into_owned());
    }
    let (local_rank, local_world_size) = local_from_hosts(&hosts, world.rank);
    Ok(World {
        local_rank,
        local_world_size,
        ..world.clone()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{free_port, local_world};
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn plain_rank_variables_need_the_store_others_do_not() {
        // Kubeflow's PyTorchJob: RANK, WORLD_SIZE, MASTER_ADDR, no LOCAL_RANK.
        let kubeflow = env(&[("RANK", "3"), ("WORLD_SIZE", "8"), ("MASTER_ADDR", "job-0")]);
        assert!(local_rank_missing(&kubeflow));
        let torchrun = env(&[("RANK", "3"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "3")]);
        assert!(!local_rank_missing(&torchrun));
        let slurm = env(&[("SLURM_PROCID", "3"), ("SLURM_LOCALID", "1")]);
        assert!(!local_rank_missing(&slurm));
        assert!(!local_rank_missing(&env(&[])));
    }

    #[test]
    fn local_ranks_count_the_ranks_before_on_the_same_host() {
        let hosts: Vec<String> = ["a", "b", "a", "b", "a"].map(String::from).to_vec();
        let got: Vec<(usize, usize)> = (0..5).map(|r| local_from_hosts(&hosts, r)).collect();
        assert_eq!(got, [(0, 3), (0, 2), (1, 3), (1, 2), (2, 3)]);
    }

    #[test]
    fn the_device_is_the_local_rank_modulo_the_visible_devices() {
        // 8 GPUs, 8 processes: one each.
        assert_eq!(
            (0..8).map(|r| device_for(r, 8)).collect::<Vec<_>>(),
            (0..8).collect::<Vec<_>>()
        );
        // One GPU per process (srun --gpus-per-task=1, CUDA_VISIBLE_DEVICES per rank): device 0.
        assert_eq!(device_for(5, 1), 0);
        // 2 processes per GPU would be refused by NCCL; the choice still exists.
        assert_eq!(device_for(3, 2), 1);
        assert_eq!(device_for(4, 0), 0, "no GPU: 0, never a division by zero");
    }

    /// Three ranks on two "hosts" meet in a real store on 127.0.0.1 and agree on local ranks.
    #[test]
    fn ranks_settle_their_local_ranks_through_the_store() {
        let port = free_port();
        let hosts = ["node-a", "node-b", "node-a"];
        let timeout = Duration::from_secs(20);
        let results: Vec<World> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..3)
                .map(|rank| {
                    s.spawn(move || {
                        let mut world = local_world(rank, 3, port);
                        // What World::from_env guesses without LOCAL_RANK.
                        world.local_rank = rank;
                        world.local_world_size = 3;
                        let store = Store::rendezvous(&world, timeout).expect("store");
                        settle_through_store(&world, &store, hosts[rank], timeout).expect("settle")
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank thread"))
                .collect()
        });
        let local: Vec<(usize, usize)> = results
            .iter()
            .map(|w| (w.local_rank, w.local_world_size))
            .collect();
        assert_eq!(local, [(0, 2), (0, 1), (1, 2)]);
        assert!(!host_name().is_empty());
    }
}
