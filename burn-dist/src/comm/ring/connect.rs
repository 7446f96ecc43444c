//! Setting up the ring: each rank listens, publishes its address through the store, connects to
//! the next rank and accepts the previous one (each handshake on its own thread, under a short
//! deadline), then decides whether the same-machine shared-memory path is usable.

use super::*;

impl TcpRing {
    /// A communicator for a world of one process: every collective is a no-op.
    pub fn single() -> Self {
        Self {
            rank: 0,
            world_size: 1,
            timeout: crate::comm::DEFAULT_TIMEOUT,
            store: None,
            links: None,
            activity: Arc::default(),
            _publisher: None,
        }
    }

    /// Connects the ring: every rank listens on an ephemeral port, publishes it through `store`,
    /// connects to rank `rank + 1` and accepts rank `rank - 1`. Connections to the listening port
    /// without the job's handshake are dropped and logged.
    ///
    /// # Errors
    /// [`DistError::StoreTimeout`]/[`DistError::RendezvousTimeout`] when a peer does not publish
    /// its address in time; [`DistError::Io`] naming the address that could not be reached.
    pub fn new(world: &World, store: Arc<Store>, timeout: Duration) -> Result<Self> {
        let rank = world.rank;
        let n = world.world_size;
        if n == 1 {
            return Ok(Self {
                rank,
                world_size: 1,
                timeout,
                store: Some(store),
                links: None,
                activity: Arc::default(),
                _publisher: None,
            });
        }
        // The interface that reaches rank 0 is the one peers can reach us on, unless overridden
        // (e.g. when a hostname resolves to 127.0.1.1 on a multi-node job).
        let ip = match std::env::var(ADDR_ENV) {
            Ok(a) => a.trim().parse().map_err(|_| DistError::InvalidEnv {
                var: ADDR_ENV.to_string(),
                value: a.clone(),
                reason: "expected an IP address of this host that the other ranks can reach".into(),
            })?,
            Err(_) => store
                .local_ip()
                .unwrap_or(std::net::IpAddr::from([127, 0, 0, 1])),
        };
        wire::require_token(
            &world.job_token,
            &[ip],
            "the ring (this rank's address for its peers)",
        )
        .map_err(|detail| DistError::NoJobToken { rank, detail })?;
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| io_err(rank, "binding the ring port", &ip.to_string(), e))?;
        let me = listener
            .local_addr()
            .map_err(|e| io_err(rank, "reading the ring port", &ip.to_string(), e))?;
        store.set(
            &format!("burn-dist/host/addr/{rank}"),
            me.to_string().as_bytes(),
        )?;
        let next_rank = (rank + 1) % n;
        let prev_rank = (rank + n - 1) % n;
        let next_addr = store.get(&format!("burn-dist/host/addr/{next_rank}"), timeout)?;
        let next_addr = String::from_utf8_lossy(&next_addr).into_owned();
        let sa: SocketAddr = next_addr.parse().map_err(|_| DistError::Store {
            addr: store.addr().to_string(),
            detail: format!("rank {next_rank} published an invalid address {next_addr:?}"),
            source: None,
        })?;
        // Connect to next in a thread while accepting prev here (both must progress at once).
        let token = world.job_token.clone();
        // The connector's outcome comes over a channel, so that the accept loop can stop at once
        // when the next rank's address turns out not to be this job's.
        let (next_tx, next_rx) = mpsc::channel();
        let connector = move || -> Result<TcpStream, HandshakeError> {
            let start = Instant::now();
            loop {
                let attempt = TcpStream::connect_timeout(&sa, Duration::from_secs(5))
                    .map_err(HandshakeError::Io)
                    .and_then(|s| {
                        tune(&s, timeout).map_err(HandshakeError::Io)?;
                        let mut timed = wire::Deadline {
                            stream: &s,
                            deadline: Instant::now() + wire::HANDSHAKE_TIMEOUT,
                        };
                        wire::client_handshake(&mut timed, ConnKind::Ring, rank, &token)?;
                        tune(&s, timeout).map_err(HandshakeError::Io)?;
                        Ok(s)
                    });
                match attempt {
                    Ok(s) => return Ok(s),
                    // Refused, or not a rank of this job: retrying will not help.
                    Err(e @ (HandshakeError::Rejected(_) | HandshakeError::Unproven(_))) => {
                        return Err(e);
                    }
                    Err(e) if start.elapsed() >= timeout => return Err(e),
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        };
        std::thread::spawn(move || {
            let _ = next_tx.send(connector());
        });
        let next_failed = |e: HandshakeError| match e {
            HandshakeError::Io(e) => io_err(
                rank,
                &format!("connecting to rank {next_rank}"),
                &next_addr,
                e,
            ),
            HandshakeError::Rejected(reason) => DistError::Unproven {
                addr: next_addr.clone(),
                rank,
                reason: format!("rank {next_rank} refused our handshake ({reason})"),
            },
            HandshakeError::Unproven(reason) => DistError::Unproven {
                addr: next_addr.clone(),
                rank,
                reason: format!("the address rank {next_rank} published: {reason}"),
            },
        };
        let mut next = None;
        let prev = Self::accept_prev(
            &listener,
            rank,
            prev_rank,
            &world.job_token,
            timeout,
            || {
                match next_rx.try_recv() {
                    Ok(Ok(s)) => next = Some(s),
                    Ok(Err(e)) => return Err(next_failed(e)),
                    Err(_) => {}
                }
                Ok(())
            },
        )?;
        let next = match next {
            Some(s) => s,
            None => next_rx
                .recv()
                .map_err(|_| {
                    io_err(
                        rank,
                        "connecting to the next rank (thread panicked)",
                        &next_addr,
                        io::Error::other("panic"),
                    )
                })?
                .map_err(next_failed)?,
        };
        let activity: Arc<failure::Activity> = Arc::default();
        let publisher = failure::Publisher::start(Arc::clone(&store), rank, Arc::clone(&activity));
        let host = Self {
            rank,
            world_size: n,
            timeout,
            activity,
            _publisher: Some(publisher),
            store: Some(store),
            links: Some(Mutex::new(Links {
                next: Link::new(next),
                prev: Link::new(prev),
                seq: 0,
                broken: None,
                shm: None,
            })),
        };
        host.barrier()?;
        let shm = host.map_shared_memory()?;
        if let Some(mut links) = host.links() {
            links.shm = shm;
        }
        Ok(host)
    }

    /// Accepts connections on the ring port until rank `prev_rank` completes the handshake. Each
    /// handshake runs on its own thread under [`wire::HANDSHAKE_TIMEOUT`], at most
    /// [`MAX_PENDING_HANDSHAKES`] at once (a new one closes the oldest), so idle or garbage
    /// connections cannot hold up the ring. `connecting` is polled on the way and stops the loop
    /// with its error (the connection to the next rank failed for good).
    fn accept_prev(
        listener: &TcpListener,
        rank: usize,
        prev_rank: usize,
        token: &str,
        timeout: Duration,
        mut connecting: impl FnMut() -> Result<()>,
    ) -> Result<TcpStream> {
        let addr = listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        listener
            .set_nonblocking(true)
            .map_err(|e| io_err(rank, "configuring the ring port", &addr, e))?;
        let pending = Arc::new(wire::Pending::new(MAX_PENDING_HANDSHAKES));
        let (done_tx, done_rx) = mpsc::channel::<(TcpStream, SocketAddr, Result<usize, String>)>();
        let start = Instant::now();
        loop {
            match listener.accept() {
                Ok((s, peer)) => {
                    let (ticket, evicted) = pending.admit(&s);
                    if let Some(old) = evicted {
                        eprintln!(
                            "[burn-dist rank {rank}] closed ring connection from {old}: \
                             {MAX_PENDING_HANDSHAKES} newer ones are in their handshake"
                        );
                    }
                    let (pending, done_tx, token) =
                        (Arc::clone(&pending), done_tx.clone(), token.to_string());
                    let spawned = std::thread::Builder::new()
                        .name("burn-dist-ring-handshake".into())
                        .spawn(move || {
                            let checked = s
                                .set_nonblocking(false)
                                .map_err(|e| e.to_string())
                                .and_then(|()| {
                                    let mut timed = wire::Deadline {
                                        stream: &s,
                                        deadline: Instant::now() + wire::HANDSHAKE_TIMEOUT,
                                    };
                                    wire::server_handshake_admitted(
                                        &mut timed,
                                        ConnKind::Ring,
                                        &token,
                                        || pending.done(ticket),
                                    )
                                });
                            pending.done(ticket);
                            // The ring may be connected already; then nobody listens.
                            let _ = done_tx.send((s, peer, checked));
                        });
                    if let Err(e) = spawned {
                        eprintln!(
                            "[burn-dist rank {rank}] could not start a handshake thread: {e}"
                        );
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(io_err(rank, "accepting the previous rank", &addr, e)),
            }
            connecting()?;
            while let Ok((s, peer, checked)) = done_rx.try_recv() {
                match checked {
                    Ok(r) if r == prev_rank => {
                        tune(&s, timeout)
                            .map_err(|e| io_err(rank, "configuring a ring socket", &addr, e))?;
                        return Ok(s);
                    }
                    Ok(r) => eprintln!(
                        "[burn-dist rank {rank}] dropped ring connection from {peer}: rank {r}, expected {prev_rank}"
                    ),
                    Err(reason) => eprintln!(
                        "[burn-dist rank {rank}] dropped ring connection from {peer}: {reason}"
                    ),
                }
            }
            if start.elapsed() >= timeout {
                return Err(DistError::Timeout {
                    op: "connecting the ring",
                    rank,
                    peer: prev_rank,
                    deadline: timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Decides (identically on every rank) whether all-reduces go through shared memory:
    /// all ranks on one machine, and every rank created its segment and mapped everyone's. The
    /// segment names are drawn by rank 0 and travel through the store (authenticated by the job
    /// token); each rank unlinks its own once everyone has mapped it.
    fn map_shared_memory(&self) -> Result<Option<crate::comm::ring::shm::Segments>> {
        let Some(store) = &self.store else {
            return Ok(None);
        };
        // Every rank runs the same collectives below whatever it decides locally (the env may
        // differ between ranks); the all-reduces make each decision unanimous.
        let willing = !std::env::var(SHM_ENV).is_ok_and(|v| v == "0");
        let me = format!("{} {}", machine_id(), std::process::id());
        store.set(&format!("burn-dist/host/node/{}", self.rank), me.as_bytes())?;
        let mut machines = Vec::with_capacity(self.world_size);
        let mut pids = Vec::with_capacity(self.world_size);
        for r in 0..self.world_size {
            let v = store.get(&format!("burn-dist/host/node/{r}"), self.timeout)?;
            let v = String::from_utf8_lossy(&v).into_owned();
            let (machine, pid) = v.rsplit_once(' ').unwrap_or(("", "0"));
            machines.push(machine.to_string());
            pids.push(pid.parse::<i32>().unwrap_or(0));
        }
        let willing = willing && machines.iter().all(|m| !m.is_empty() && *m == machines[0]);
        let name_key = "burn-dist/host/shm-name";
        if self.rank == 0 {
            store.set(
                name_key,
                format!("{:032x}", rand::random::<u128>()).as_bytes(),
            )?;
        }
        let name = String::from_utf8_lossy(&store.get(name_key, self.timeout)?).into_owned();
        let unanimous = |ok: bool| -> Result<bool> {
            let mut all = [i64::from(ok)];
            self.all_reduce(HostBuf::I64(&mut all), ReduceOp::Min)?;
            Ok(all[0] == 1)
        };
        let own = willing.then(|| crate::comm::ring::shm::create(&name, self.rank));
        if let Some(Err(e)) = &own {
            eprintln!(
                "[burn-dist rank {}] no shared-memory segment in /dev/shm ({e}); same-machine \
                 all-reduces use the TCP ring",
                self.rank
            );
        }
        let created = unanimous(matches!(own, Some(Ok(_))))?;
        let maps: Option<Vec<memmap2::MmapMut>> = match own {
            Some(Ok(own)) if created => {
                let mut own = Some(own);
                (0..self.world_size)
                    .map(|q| {
                        if q == self.rank {
                            own.take()
                                .ok_or_else(|| std::io::Error::other("mapped twice"))
                        } else {
                            crate::comm::ring::shm::open(&name, q)
                        }
                    })
                    .collect::<std::io::Result<Vec<_>>>()
                    .ok()
            }
            _ => None,
        };
        let mapped = unanimous(maps.is_some())?;
        if willing {
            crate::comm::ring::shm::unlink(&name, self.rank);
        }
        Ok(maps
            .filter(|_| mapped)
            .map(|maps| crate::comm::ring::shm::Segments::new(self.rank, maps, pids)))
    }
}

/// This machine's boot id (same on every process of one machine, across containers too).
fn machine_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}
