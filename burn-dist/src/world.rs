//! Who am I in the job: rank, world size and where rank 0 listens, read from the environment.

use crate::error::{DistError, Result};

/// Default rendezvous port, as torchrun.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Environment variable holding the job token the launcher hands to its workers.
pub const JOB_TOKEN_ENV: &str = "BURN_DIST_JOB_TOKEN";

/// Environment variable set by the launcher on every rank but 0: do not draw progress bars.
pub const QUIET_ENV: &str = "BURN_DIST_QUIET";

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
    /// Host of rank 0's rendezvous store.
    pub master_addr: String,
    /// Port of rank 0's rendezvous store.
    pub master_port: u16,
    /// Shared secret of the job (from [`JOB_TOKEN_ENV`], empty when unset).
    pub job_token: String,
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
        }
    }

    /// Reads the world from the process environment: torchrun's `RANK WORLD_SIZE LOCAL_RANK
    /// LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT`, else SLURM's `SLURM_PROCID SLURM_NTASKS
    /// SLURM_LOCALID SLURM_NTASKS_PER_NODE`, else OpenMPI's `OMPI_COMM_WORLD_*`; world size 1 when
    /// none is set.
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
        let (rank_var, size_var, lrank_var, lsize_var) =
            if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
                ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
            } else if get("SLURM_PROCID").is_some() && get("SLURM_NTASKS").is_some() {
                (
                    "SLURM_PROCID",
                    "SLURM_NTASKS",
                    "SLURM_LOCALID",
                    "SLURM_NTASKS_PER_NODE",
                )
            } else if get("OMPI_COMM_WORLD_RANK").is_some() {
                (
                    "OMPI_COMM_WORLD_RANK",
                    "OMPI_COMM_WORLD_SIZE",
                    "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE",
                )
            } else {
                let mut w = Self::single();
                w.job_token = token;
                if let Some(p) = get("MASTER_PORT") {
                    w.master_port = parse_port(&p)?;
                }
                return Ok(w);
            };
        let num = |var: &str, required: bool, default: usize| -> Result<usize> {
            match get(var) {
                Some(v) => {
                    // SLURM_NTASKS_PER_NODE may look like "4(x2)": take the leading number.
                    let lead: String = v
                        .trim()
                        .chars()
                        .take_while(|c| c.is_ascii_digit())
                        .collect();
                    lead.parse::<usize>().map_err(|_| DistError::InvalidEnv {
                        var: var.to_string(),
                        value: v.clone(),
                        reason: "expected a non-negative integer".to_string(),
                    })
                }
                None if required => Err(DistError::MissingEnv {
                    var: var.to_string(),
                    reason: "it must be set together with the other rank variables".to_string(),
                }),
                None => Ok(default),
            }
        };
        let rank = num(rank_var, true, 0)?;
        let world_size = num(size_var, true, 1)?;
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
        let local_rank = num(lrank_var, false, rank)?;
        let local_world_size = num(lsize_var, false, world_size)?;
        if local_rank >= local_world_size {
            return Err(DistError::InvalidEnv {
                var: lrank_var.to_string(),
                value: local_rank.to_string(),
                reason: format!(
                    "the local rank must be smaller than {lsize_var}={local_world_size}"
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
            _ if world_size > 1 => {
                return Err(DistError::MissingEnv {
                    var: "MASTER_ADDR".to_string(),
                    reason: format!(
                        "{size_var}={world_size} needs the host of rank 0's rendezvous store"
                    ),
                });
            }
            _ => "127.0.0.1".to_string(),
        };
        let master_port = match get("MASTER_PORT") {
            Some(p) => parse_port(&p)?,
            None => DEFAULT_MASTER_PORT,
        };
        Ok(Self {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            job_token: token,
        })
    }

    /// `host:port` of rank 0's store.
    pub fn master_endpoint(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }

    /// Whether this process is rank 0.
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }
}

fn parse_port(p: &str) -> Result<u16> {
    p.trim().parse::<u16>().map_err(|_| DistError::InvalidEnv {
        var: "MASTER_PORT".to_string(),
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
            ("SLURM_NTASKS_PER_NODE", "2(x1)"),
            ("MASTER_ADDR", "h"),
        ])
        .expect("slurm");
        assert_eq!((w.rank, w.world_size, w.local_world_size), (1, 2, 2));
        let w =
            world(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "1")]).expect("mpi");
        assert_eq!(w.world_size, 1);
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
