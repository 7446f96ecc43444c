//! Who am I in the job: rank, world size and where the rendezvous store is, read from the
//! environment that torchrun, SLURM's `srun`, OpenMPI's `mpirun` or our own launcher set.

use crate::error::{DistError, Result};
use crate::rendezvous::slurm;

/// Default rendezvous port, as torchrun.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Environment variable holding the job token the launcher hands to its workers.
pub const JOB_TOKEN_ENV: &str = "BURN_DIST_JOB_TOKEN";

/// Environment variable set by the launcher on every rank but 0: do not draw progress bars.
pub const QUIET_ENV: &str = "BURN_DIST_QUIET";

/// Who serves the job's rendezvous store.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Rendezvous {
    /// Rank 0 serves burn-dist's own store on `MASTER_PORT` (our launcher, SLURM, OpenMPI).
    #[default]
    OwnStore,
    /// torchrun's agent already serves a torch `TCPStore` on `MASTER_PORT`
    /// (`TORCHELASTIC_USE_AGENT_STORE=True`): every rank joins it as a client.
    TorchAgentStore {
        /// Prefix of every key, one per run and restart so that a restarted job never reads the
        /// previous attempt's keys: `/burn-dist/<TORCHELASTIC_RUN_ID>/attempt_<TORCHELASTIC_RESTART_COUNT>/`.
        key_prefix: String,
    },
}

/// A process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct World {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of processes in the job.
    pub world_size: usize,
    /// Rank on this node, `0..local_world_size` (selects the GPU).
    pub local_rank: usize,
    /// Number of processes on this node.
    pub local_world_size: usize,
    /// Host of the rendezvous store.
    pub master_addr: String,
    /// Port of the rendezvous store.
    pub master_port: u16,
    /// Shared secret of the job (from [`JOB_TOKEN_ENV`], empty when unset).
    pub job_token: String,
    /// Who serves the rendezvous store.
    pub rendezvous: Rendezvous,
}

/// The launcher whose variables describe the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Launcher {
    /// torchrun or burn-dist's launcher (`RANK`, `WORLD_SIZE`, ...).
    Torchrun,
    Slurm,
    OpenMpi,
}

impl World {
    /// A single process world (rank 0 of 1).
    pub fn single() -> Self {
        Self {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".to_string(),
            master_port: DEFAULT_MASTER_PORT,
            job_token: String::new(),
            rendezvous: Rendezvous::OwnStore,
        }
    }

    /// Reads the world from the process environment: torchrun's `RANK WORLD_SIZE LOCAL_RANK
    /// LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT` (and `TORCHELASTIC_*`), else SLURM's
    /// `SLURM_PROCID SLURM_NTASKS SLURM_LOCALID SLURM_TASKS_PER_NODE SLURM_NODEID`, else OpenMPI's
    /// `OMPI_COMM_WORLD_*`; world size 1 when none is set.
    ///
    /// Under SLURM without `MASTER_ADDR`/`MASTER_PORT`, rank 0's host is the first host of
    /// `SLURM_STEP_NODELIST` (else `SLURM_JOB_NODELIST`) and the port is derived from
    /// `SLURM_JOB_ID`.
    ///
    /// # Errors
    /// [`DistError::InvalidEnv`] or [`DistError::MissingEnv`] naming the variable when values are
    /// unparsable or inconsistent (rank ≥ world size, no master address with world size > 1).
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Same as [`World::from_env`], reading variables through `get` (for tests).
    ///
    /// # Errors
    /// As [`World::from_env`].
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let token = get(JOB_TOKEN_ENV).unwrap_or_default();
        let launcher = if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
            Launcher::Torchrun
        } else if get("SLURM_PROCID").is_some() && get("SLURM_NTASKS").is_some() {
            Launcher::Slurm
        } else if get("OMPI_COMM_WORLD_RANK").is_some() {
            Launcher::OpenMpi
        } else {
            let mut w = Self::single();
            w.job_token = token;
            if let Some(p) = get("MASTER_PORT") {
                w.master_port = parse_port("MASTER_PORT", &p)?;
            }
            return Ok(w);
        };
        let (rank_var, size_var, lrank_var, lsize_var) = match launcher {
            Launcher::Torchrun => ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
            Launcher::Slurm => (
                "SLURM_PROCID",
                "SLURM_NTASKS",
                "SLURM_LOCALID",
                "SLURM_TASKS_PER_NODE",
            ),
            Launcher::OpenMpi => (
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE",
            ),
        };
        let num = |var: &str| -> Result<Option<usize>> {
            get(var)
                .map(|v| {
                    v.trim()
                        .parse::<usize>()
                        .map_err(|_| DistError::InvalidEnv {
                            var: var.to_string(),
                            value: v.clone(),
                            reason: "expected a non-negative integer".to_string(),
                        })
                })
                .transpose()
        };
        let required = |var: &str, reason: &str| -> Result<usize> {
            num(var)?.ok_or_else(|| DistError::MissingEnv {
                var: var.to_string(),
                reason: reason.to_string(),
            })
        };
        let together = "it must be set together with the other rank variables";
        let rank = required(rank_var, together)?;
        let world_size = required(size_var, together)?;
        if world_size == 0 {
            return Err(DistError::InvalidEnv {
                var: size_var.to_string(),
                value: "0".to_string(),
                reason: "the world size must be at least 1".to_string(),
            });
        }
        if rank >= world_size {
            return Err(DistError::InvalidEnv {
                var: rank_var.to_string(),
                value: rank.to_string(),
                reason: format!("the rank must be smaller than {size_var}={world_size}"),
            });
        }
        let (local_rank, local_world_size) = if launcher == Launcher::Slurm {
            let srun = "srun sets it for every task";
            (
                required(lrank_var, srun)?,
                slurm_local_world_size(&get, world_size)?,
            )
        } else {
            (
                num(lrank_var)?.unwrap_or(rank),
                num(lsize_var)?.unwrap_or(world_size),
            )
        };
        if local_rank >= local_world_size {
            return Err(DistError::InvalidEnv {
                var: lrank_var.to_string(),
                value: local_rank.to_string(),
                reason: format!(
                    "the local rank must be smaller than the {local_world_size} processes on this \
                     node ({lsize_var})"
                ),
            });
        }
        if local_world_size > world_size {
            return Err(DistError::InvalidEnv {
                var: lsize_var.to_string(),
                value: local_world_size.to_string(),
                reason: format!("the local world size cannot exceed {size_var}={world_size}"),
            });
        }
        let master_addr = match get("MASTER_ADDR") {
            Some(a) if !a.trim().is_empty() => a.trim().to_string(),
            _ if launcher == Launcher::Slurm => slurm_master_addr(&get)?,
            _ if world_size > 1 => {
                let reason = if launcher == Launcher::OpenMpi {
                    format!(
                        "{size_var}={world_size} needs the host of rank 0's rendezvous store, and \
                         mpirun does not set it: add `-x MASTER_ADDR=<host of rank 0>` (and \
                         optionally `-x MASTER_PORT={DEFAULT_MASTER_PORT}`) to the mpirun command"
                    )
                } else {
                    format!("{size_var}={world_size} needs the host of rank 0's rendezvous store")
                };
                return Err(DistError::MissingEnv {
                    var: "MASTER_ADDR".to_string(),
                    reason,
                });
            }
            _ => "127.0.0.1".to_string(),
        };
        let master_port = match (get("MASTER_PORT"), get("SLURM_JOB_ID")) {
            (Some(p), _) => parse_port("MASTER_PORT", &p)?,
            (None, Some(id)) if launcher == Launcher::Slurm => slurm::port_from_job_id(&id)
                .map_err(|reason| DistError::InvalidEnv {
                    var: "SLURM_JOB_ID".to_string(),
                    value: id.clone(),
                    reason: format!(
                        "{reason}; the rendezvous port is derived from it when MASTER_PORT is unset"
                    ),
                })?,
            _ => DEFAULT_MASTER_PORT,
        };
        let agent_store = get("TORCHELASTIC_USE_AGENT_STORE")
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true") || v.trim() == "1");
        let rendezvous = if launcher == Launcher::Torchrun && agent_store {
            let run_id = get("TORCHELASTIC_RUN_ID").unwrap_or_else(|| "none".to_string());
            let restart = get("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|| "0".to_string());
            Rendezvous::TorchAgentStore {
                key_prefix: format!("/burn-dist/{}/attempt_{}/", run_id.trim(), restart.trim()),
            }
        } else {
            Rendezvous::OwnStore
        };
        Ok(Self {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            job_token: token,
            rendezvous,
        })
    }

    /// `host:port` of the rendezvous store.
    pub fn master_endpoint(&self) -> String {
        crate::rendezvous::store::endpoint(&self.master_addr, self.master_port)
    }

    /// Whether this process is rank 0.
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }
}

/// Tasks on this node under SLURM: this node's entry of `SLURM_STEP_TASKS_PER_NODE` (or
/// `SLURM_TASKS_PER_NODE`), indexed by `SLURM_NODEID`.
fn slurm_local_world_size(
    get: &impl Fn(&str) -> Option<String>,
    world_size: usize,
) -> Result<usize> {
    let Some((var, spec)) = ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]
        .iter()
        .find_map(|v| get(v).map(|s| (*v, s)))
    else {
        return Err(DistError::MissingEnv {
            var: "SLURM_TASKS_PER_NODE".to_string(),
            reason: "srun sets it; it says how many tasks run on this node".to_string(),
        });
    };
    let invalid = |var: &str, value: &str, reason: String| DistError::InvalidEnv {
        var: var.to_string(),
        value: value.to_string(),
        reason,
    };
    let counts = slurm::tasks_per_node(&spec).map_err(|r| invalid(var, &spec, r))?;
    if counts.iter().sum::<usize>() != world_size {
        return Err(invalid(
            var,
            &spec,
            format!(
                "the tasks per node add up to {}, not SLURM_NTASKS={world_size}",
                counts.iter().sum::<usize>()
            ),
        ));
    }
    let node = match get("SLURM_NODEID") {
        Some(n) => n
            .trim()
            .parse::<usize>()
            .map_err(|_| invalid("SLURM_NODEID", &n, "expected a non-negative integer".into()))?,
        None if counts.iter().all(|c| *c == counts[0]) => 0,
        None => {
            return Err(DistError::MissingEnv {
                var: "SLURM_NODEID".to_string(),
                reason: format!("{var}={spec} differs between nodes; srun sets it"),
            });
        }
    };
    counts.get(node).copied().ok_or_else(|| {
        invalid(
            "SLURM_NODEID",
            &node.to_string(),
            format!("{var}={spec} lists only {} nodes", counts.len()),
        )
    })
}

/// Rank 0's host under SLURM: the first host of the step's (else the job's) node list.
fn slurm_master_addr(get: &impl Fn(&str) -> Option<String>) -> Result<String> {
    let Some((var, list)) = [
        "SLURM_STEP_NODELIST",
        "SLURM_JOB_NODELIST",
        "SLURM_NODELIST",
    ]
    .iter()
    .find_map(|v| get(v).map(|s| (*v, s))) else {
        return Err(DistError::MissingEnv {
            var: "MASTER_ADDR".to_string(),
            reason: "under SLURM it defaults to the first host of SLURM_JOB_NODELIST, which is \
                     not set either; export MASTER_ADDR=<host of rank 0>"
                .to_string(),
        });
    };
    let invalid = |reason: String| DistError::InvalidEnv {
        var: var.to_string(),
        value: list.clone(),
        reason: format!("{reason}; rank 0's host is its first host (or set MASTER_ADDR)"),
    };
    // Task 0 runs on the first host with srun's default (block) distribution.
    slurm::expand_hostlist(&list)
        .map_err(invalid)?
        .into_iter()
        .next()
        .ok_or_else(|| invalid("no host".to_string()))
}

fn parse_port(var: &str, p: &str) -> Result<u16> {
    p.trim().parse::<u16>().map_err(|_| DistError::InvalidEnv {
        var: var.to_string(),
        value: p.to_string(),
        reason: "expected a TCP port number 0-65535".to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn world(vars: &[(&str, &str)]) -> Result<World> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        World::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn no_env_is_single() {
        let w = world(&[]).expect("single");
        assert_eq!((w.rank, w.world_size), (0, 1));
    }

    #[test]
    fn torchrun_env() {
        let w = world(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
        ])
        .expect("valid");
        assert_eq!(
            (w.rank, w.world_size, w.local_rank, w.local_world_size),
            (3, 4, 1, 2)
        );
        assert_eq!(w.master_endpoint(), "10.0.0.1:1234");
    }

    #[test]
    fn slurm_and_mpi_env() {
        let w = world(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_TASKS_PER_NODE", "2"),
            ("SLURM_NODEID", "0"),
            ("MASTER_ADDR", "h"),
        ])
        .expect("slurm");
        assert_eq!((w.rank, w.world_size, w.local_world_size), (1, 2, 2));
        let w =
            world(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "1")]).expect("mpi");
        assert_eq!(w.world_size, 1);
    }

    #[test]
    fn torchrun_agent_store_gets_a_prefix_per_run_and_restart() {
        let torchrun = |agent_store: &'static str, restart: &'static str| {
            world(&[
                ("RANK", "1"),
                ("WORLD_SIZE", "2"),
                ("LOCAL_RANK", "1"),
                ("LOCAL_WORLD_SIZE", "2"),
                ("MASTER_ADDR", "localhost"),
                ("MASTER_PORT", "29500"),
                ("TORCHELASTIC_RUN_ID", "job7"),
                ("TORCHELASTIC_RESTART_COUNT", restart),
                ("TORCHELASTIC_USE_AGENT_STORE", agent_store),
            ])
            .expect("torchrun")
            .rendezvous
        };
        assert_eq!(
            torchrun("True", "2"),
            Rendezvous::TorchAgentStore {
                key_prefix: "/burn-dist/job7/attempt_2/".into()
            }
        );
        assert_ne!(torchrun("True", "3"), torchrun("True", "2"));
        assert_eq!(torchrun("False", "2"), Rendezvous::OwnStore);
        let plain = world(&[("RANK", "0"), ("WORLD_SIZE", "1")]).expect("plain");
        assert_eq!(plain.rendezvous, Rendezvous::OwnStore);
    }

    #[test]
    fn slurm_alone_gives_the_master_and_the_local_world() {
        let w = world(&[
            ("SLURM_PROCID", "9"),
            ("SLURM_NTASKS", "11"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "2"),
            ("SLURM_TASKS_PER_NODE", "4(x2),3"),
            ("SLURM_JOB_NODELIST", "gpu[01-02,07]"),
            ("SLURM_JOB_ID", "123456"),
        ])
        .expect("slurm");
        assert_eq!(
            (w.rank, w.world_size, w.local_rank, w.local_world_size),
            (9, 11, 1, 3)
        );
        assert_eq!(w.master_endpoint(), "gpu01:18456");
        // The step's own lists win over the job's: a step may run on some of the job's nodes.
        let w = world(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "0"),
            ("SLURM_TASKS_PER_NODE", "4(x2)"),
            ("SLURM_STEP_TASKS_PER_NODE", "1(x2)"),
            ("SLURM_JOB_NODELIST", "n[1-4]"),
            ("SLURM_STEP_NODELIST", "n[3-4]"),
            ("MASTER_PORT", "777"),
        ])
        .expect("slurm step");
        assert_eq!(w.local_world_size, 1);
        assert_eq!(w.master_endpoint(), "n3:777");
    }

    #[test]
    fn slurm_and_mpirun_errors_say_what_to_set() {
        let slurm = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "0"),
            ("SLURM_TASKS_PER_NODE", "2(x2)"),
        ];
        let e = world(&slurm).expect_err("no node list");
        assert!(e.to_string().contains("SLURM_JOB_NODELIST"), "{e}");
        let mut bad = slurm.to_vec();
        bad.push(("SLURM_JOB_NODELIST", "n[1-2"));
        let e = world(&bad).expect_err("bad node list");
        assert!(
            e.to_string().contains("SLURM_JOB_NODELIST=\"n[1-2\""),
            "{e}"
        );
        let mut bad = slurm.to_vec();
        bad[4] = ("SLURM_TASKS_PER_NODE", "3");
        let e = world(&bad).expect_err("tasks do not add up");
        assert!(e.to_string().contains("SLURM_NTASKS=4"), "{e}");
        let mut bad = slurm.to_vec();
        bad[3] = ("SLURM_NODEID", "2");
        let e = world(&bad).expect_err("node out of range");
        assert!(e.to_string().contains("SLURM_NODEID"), "{e}");
        let e = world(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")])
            .expect_err("mpirun without MASTER_ADDR");
        assert!(
            e.to_string().contains("MASTER_ADDR") && e.to_string().contains("-x MASTER_ADDR="),
            "{e}"
        );
    }

    #[test]
    fn inconsistent_values_name_the_variable() {
        let e = world(&[("RANK", "4"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "h")])
            .expect_err("rank too big");
        assert!(e.to_string().contains("RANK=\"4\""), "{e}");
        let e = world(&[("RANK", "0"), ("WORLD_SIZE", "2")]).expect_err("no master");
        assert!(e.to_string().contains("MASTER_ADDR"), "{e}");
        let e = world(&[("RANK", "x"), ("WORLD_SIZE", "2")]).expect_err("garbage");
        assert!(e.to_string().contains("RANK"), "{e}");
        let e = world(&[("RANK", "0")]).expect_err("missing size");
        assert!(e.to_string().contains("WORLD_SIZE"), "{e}");
    }
}
