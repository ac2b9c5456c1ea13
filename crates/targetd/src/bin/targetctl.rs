//! `targetctl [--socket PATH] COMMAND`: administers a running targetd over its admin socket.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use serde_json::Value;
use targetd::admin::{AdminRequest, AdminResponse};
use targetd::config;

/// Where the packaged unit (packaging/targetd.service, packaging/config.toml) puts the admin
/// socket.
const PACKAGED_SOCKET: &str = "/run/targetd/targetd.sock";

/// Administers a running targetd.
#[derive(Parser)]
#[command(name = "targetctl", version)]
struct Args {
    /// The daemon's admin socket (server.admin_socket in its config). By default
    /// $TARGETD_SOCKET, else ./targetd.sock where it exists (the repository's config puts it
    /// beside config.toml), else /run/targetd/targetd.sock (the packaged unit's).
    #[arg(long, short, env = "TARGETD_SOCKET", global = true)]
    socket: Option<PathBuf>,
    /// Print the daemon's JSON answer instead of a table (before or after the subcommand).
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

// Parsed once per run: the size of the largest variant (lun add's options) costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Version, uptime, portals, engine and counts.
    Status,
    /// Targets, their LUNs and sessions.
    Targets,
    /// Logical units.
    Luns {
        /// Only this target's.
        target: Option<String>,
    },
    /// NVM subsystems (NVMe/TCP): namespaces and the controllers connected.
    Subsystems,
    /// Sessions: initiator, address, negotiated keys.
    Sessions,
    /// Each target as a tree: its portals, who may log in (ACLs, CHAP), its LUNs and their
    /// backing, as the running config has them.
    Tree,
    /// Prints a completion script for `shell` (e.g. `targetctl completions bash >
    /// /etc/bash_completion.d/targetctl`); needs no daemon.
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Writes targetctl's man pages into DIR: targetctl.1 and one page per subcommand
    /// (targetctl-lun-add.1), e.g. `targetctl man /usr/local/share/man/man1`; needs no daemon.
    Man {
        /// An existing directory.
        dir: PathBuf,
    },
    /// Per-LU IOPS, throughput and latency over an interval.
    Stats {
        /// How long to sample over (1s, 500ms, 1m; a bare number is seconds); 0 prints the
        /// totals since start.
        #[arg(long, default_value = "1s", value_parser = units::parse_duration)]
        interval: Duration,
    },
    /// Logical units: add, remove, resize.
    Lun {
        #[command(subcommand)]
        action: LunAction,
    },
    /// NVM subsystems: add, remove, at once (`config save` keeps them).
    Subsystem {
        #[command(subcommand)]
        action: SubsystemAction,
    },
    /// NVMe namespaces of a subsystem: add, remove, resize (`config save` keeps them).
    Namespace {
        #[command(subcommand)]
        action: NamespaceAction,
    },
    /// Targets: add, set (access rules, CHAP), remove.
    Target {
        #[command(subcommand)]
        action: TargetAction,
    },
    /// iSCSI portals: add, remove, at once (`config save` keeps them).
    Portal {
        #[command(subcommand)]
        action: PortalAction,
    },
    /// Sessions: kill.
    Session {
        #[command(subcommand)]
        action: SessionAction,
    },
    /// The running config.
    Config {
        #[command(subcommand)]
        action: ConfigAction,
    },
    /// The cluster of gateways (`[cluster]`): its members, which are alive, each shared
    /// unit's ALUA state per port group and its reservation holder; `cluster forget GATEWAY`
    /// takes a gateway that is gone for good out of it.
    Cluster {
        #[command(subcommand)]
        action: Option<ClusterAction>,
    },
    /// Cross-layer command tracing: start, stop.
    Trace {
        #[command(subcommand)]
        action: TraceAction,
    },
    /// Replaces the running targetd by a new binary without ending a session: the new one
    /// (its `--check` first) takes over every listening socket, every iSCSI/TCP session and
    /// every NVMe/TCP controller on its connections (initiators see a pause, no logout); the
    /// old one then exits. iSER and SRP sessions are asked to log out and reconnect. Any
    /// failure leaves the old one serving every session as before.
    Upgrade {
        /// The new binary (default: the running one's path, as after a package upgrade).
        #[arg(long)]
        binary: Option<PathBuf>,
        /// Also when memory units would come up empty in the new process, or what targetctl
        /// made live and nobody saved would be lost.
        #[arg(long)]
        force: bool,
        /// How long the new binary may take to start (1m, 90s; a bare number is seconds).
        #[arg(long, default_value = "60s", value_parser = parse_duration)]
        start_timeout: Duration,
        /// How long the sessions may take to finish their commands in flight and park; at
        /// this deadline WRITEs whose data their initiators still owe are aborted (TASK
        /// ABORTED, sent again by the initiator), and the rest gets one second more.
        #[arg(long, default_value = "10s", value_parser = parse_duration)]
        park_timeout: Duration,
    },
}

#[derive(Subcommand)]
enum ClusterAction {
    /// Takes a gateway that is gone for good (not alive) out of the cluster, so its port
    /// group is no longer reported, unavailable, for every unit. A gateway stopped by SIGTERM
    /// leaves by itself.
    Forget {
        /// Its `cluster.gateway`.
        gateway: String,
    },
}

#[derive(Subcommand)]
enum TraceAction {
    /// Records every command's stages on every reactor until `trace stop` (or the duration).
    Start {
        /// The trace file the daemon writes at the stop.
        #[arg(long)]
        out: PathBuf,
        /// Stop by itself after this long (10s, 500ms, 2m).
        #[arg(long)]
        duration: Option<String>,
        /// Records each reactor keeps (32 bytes each; default 1048576): a reactor whose ring
        /// fills drops the rest, and the daemon warns.
        #[arg(long)]
        records: Option<usize>,
    },
    /// Stops the trace and writes its file.
    Stop,
}

/// A path as the caller means it: relative paths resolve against targetctl's working
/// directory, not the daemon's (`lun add --path`, `--ceph-conf`, `--keyring`; `trace start
/// --out` likewise).
fn absolute(p: PathBuf) -> anyhow::Result<PathBuf> {
    Ok(std::path::absolute(&p)?)
}

/// A positive duration like 10s, 500ms, 2m or 1h30m (the config's grammar: units::parse_duration).
fn parse_duration(s: &str) -> anyhow::Result<Duration> {
    let d = units::parse_duration(s).map_err(anyhow::Error::msg)?;
    if d.is_zero() {
        anyhow::bail!("{s:?} is not a positive duration");
    }
    Ok(d)
}

/// What stores a unit's blocks and how it is offered: a LUN's (`lun add`) or a namespace's
/// (`namespace add`) keys, as in the config file.
#[derive(clap::Args)]
struct UnitArgs {
    /// What stores the unit's blocks.
    #[arg(long, default_value = "file", value_parser = ["file", "memory", "null", "rbd"])]
    backend: String,
    /// The backing file (file backend).
    #[arg(long)]
    path: Option<PathBuf>,
    /// Size, e.g. 1GiB (created sparse when the file is missing).
    #[arg(long)]
    size: Option<String>,
    /// 512 or 4096.
    #[arg(long, default_value_t = 512)]
    block_size: u32,
    /// Fully provisioned (no UNMAP).
    #[arg(long)]
    thick: bool,
    /// Write-through (no volatile write cache).
    #[arg(long)]
    write_through: bool,
    /// Read-only.
    #[arg(long)]
    read_only: bool,
    /// MAXIMUM TRANSFER LENGTH of the Block Limits page, e.g. 8MiB (default 32 MiB).
    #[arg(long)]
    max_transfer_length: Option<String>,
    /// OPTIMAL TRANSFER LENGTH, e.g. 1MiB (the default): Linux sends at most this per
    /// command.
    #[arg(long)]
    optimal_transfer_length: Option<String>,
    /// rbd: the pool.
    #[arg(long)]
    pool: Option<String>,
    /// rbd: the RADOS namespace in the pool.
    #[arg(long)]
    namespace: Option<String>,
    /// rbd: the image (created at --size when missing).
    #[arg(long)]
    image: Option<String>,
    /// rbd: the cluster's ceph.conf (default: librados' search).
    #[arg(long)]
    ceph_conf: Option<PathBuf>,
    /// rbd: the cephx id, without "client." (default admin).
    #[arg(long)]
    client: Option<String>,
    /// rbd: the keyring with the client's key.
    #[arg(long)]
    keyring: Option<PathBuf>,
    /// rbd: seconds the cluster may take to answer (default 20).
    #[arg(long)]
    ceph_timeout: Option<u64>,
    /// rbd in a cluster: the gateway that is active/optimized for this unit while live.
    #[arg(long)]
    preferred_gateway: Option<String>,
    /// rbd in a cluster: the other live gateways are standby for this unit, not
    /// active/non-optimized.
    #[arg(long)]
    standby: bool,
}

impl UnitArgs {
    /// The unit as the config has it (`lun` its LUN; 0 for a namespace).
    fn into_lun(self, lun: u16) -> anyhow::Result<config::Lun> {
        let size_of = |s: Option<String>| {
            s.map(|s| config::parse_size(&s).map(config::Size))
                .transpose()
                .map_err(anyhow::Error::msg)
        };
        Ok(config::Lun {
            lun,
            backend: self.backend,
            path: self.path.map(absolute).transpose()?,
            size: size_of(self.size)?,
            block_size: self.block_size,
            thin: !self.thick,
            write_cache: !self.write_through,
            read_only: self.read_only,
            direct: false,
            max_transfer_length: size_of(self.max_transfer_length)?,
            optimal_transfer_length: size_of(self.optimal_transfer_length)?,
            pool: self.pool,
            namespace: self.namespace,
            image: self.image,
            ceph_conf: self.ceph_conf.map(absolute).transpose()?,
            client: self.client,
            keyring: self.keyring.map(absolute).transpose()?,
            ceph_timeout: self.ceph_timeout,
            preferred_gateway: self.preferred_gateway,
            standby: self.standby,
        })
    }
}

#[derive(Subcommand)]
enum SubsystemAction {
    /// Exports a new NVM subsystem, without namespaces (add them with `namespace add`); the
    /// discovery log lists it at once.
    Add {
        /// Its NQN (nqn.yyyy-mm.reverse.domain:name).
        nqn: String,
        /// Host NQNs allowed to connect (repeat the option; none: any host).
        #[arg(long = "host")]
        hosts: Vec<String>,
        /// The serial number its controllers report (default: derived from the NQN).
        #[arg(long)]
        serial: Option<String>,
        /// The model its controllers report (default: targetd).
        #[arg(long)]
        model: Option<String>,
    },
    /// Stops exporting a subsystem: its connections close, its namespaces are flushed and
    /// closed. Refused while controllers are connected, unless --force.
    Remove {
        /// Its NQN.
        nqn: String,
        /// Remove it even while controllers are connected (their hosts lose it).
        #[arg(long)]
        force: bool,
    },
}

#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum NamespaceAction {
    /// Adds a namespace to an NVM subsystem; its connected controllers get a Namespace
    /// Attribute Changed notice (Linux's host rescans and the block device appears).
    Add {
        /// The subsystem's NQN.
        subsystem: String,
        /// The NSID (1 to 1024).
        nsid: u32,
        #[command(flatten)]
        unit: UnitArgs,
    },
    /// Removes a namespace. Refused while controllers are connected, unless --force.
    Remove {
        /// The subsystem's NQN.
        subsystem: String,
        /// The NSID.
        nsid: u32,
        /// Remove it even while controllers are connected (their hosts lose it).
        #[arg(long)]
        force: bool,
    },
    /// Resizes a namespace; its connected controllers hear of the new size.
    Resize {
        /// The subsystem's NQN.
        subsystem: String,
        /// The NSID.
        nsid: u32,
        /// The new size, e.g. 2GiB.
        size: String,
        /// Allow a smaller size (the blocks past it are cut off).
        #[arg(long)]
        force: bool,
    },
}

#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum LunAction {
    /// Adds a logical unit to a target.
    Add {
        /// The target.
        target: String,
        /// The LUN.
        lun: u16,
        #[command(flatten)]
        unit: UnitArgs,
    },
    /// Removes a logical unit; its commands are aborted. Refused while initiators are logged
    /// in to its target, unless --force.
    Remove {
        /// The target.
        target: String,
        /// The LUN.
        lun: u16,
        /// Remove it even while initiators are logged in (they lose it).
        #[arg(long)]
        force: bool,
    },
    /// Resizes a logical unit; initiators get CAPACITY DATA HAS CHANGED.
    Resize {
        /// The target.
        target: String,
        /// The LUN.
        lun: u16,
        /// The new size, e.g. 2GiB.
        size: String,
        /// Allow a smaller size (the blocks past it are cut off).
        #[arg(long)]
        force: bool,
    },
    /// Makes a logical unit fail as a failing disk would, to rehearse or test what initiators
    /// see (MEDIUM ERROR for eio, DATA PROTECT / SPACE ALLOCATION FAILED for enospc); a failed
    /// write writes nothing. `--clear` disarms every fault of the unit.
    Fault {
        /// The target.
        target: String,
        /// The LUN.
        lun: u16,
        /// The operations that fail.
        #[arg(long, value_parser = ["read", "write", "flush", "all"], required_unless_present = "clear")]
        ops: Option<String>,
        /// The error they get.
        #[arg(long, value_parser = ["eio", "enospc"], default_value = "eio")]
        error: String,
        /// First block of the failing range.
        #[arg(long, default_value_t = 0)]
        lba: u64,
        /// Blocks in the failing range (0: the whole unit).
        #[arg(long, default_value_t = 0)]
        blocks: u64,
        /// Fail this many operations, then disarm (default: until cleared).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        count: Option<u64>,
        /// Disarm every fault of the unit instead.
        #[arg(long, conflicts_with_all = ["ops", "lba", "blocks", "count"])]
        clear: bool,
    },
}

#[derive(Subcommand)]
enum PortalAction {
    /// Listens on one more address (`host:port`; port 0 picks a free one).
    Add {
        /// The address.
        address: String,
    },
    /// Stops listening on a portal; its connections stay.
    Remove {
        /// As added, or the address it listens on.
        address: String,
    },
}

#[derive(Subcommand)]
enum TargetAction {
    /// Adds a target without LUNs (add them with `lun add`).
    Add {
        /// Its iSCSI name.
        name: String,
        /// Initiator names allowed (any when none given).
        #[arg(long = "initiator")]
        initiators: Vec<String>,
        /// Source networks allowed, CIDR (any when none given).
        #[arg(long = "network")]
        networks: Vec<String>,
        /// SRP initiator port identifiers allowed, 32 hex digits (see `srp_initiators`).
        #[arg(long = "srp-initiator")]
        srp_initiators: Vec<String>,
    },
    /// Changes a target's access rules for new logins (sessions logged in stay). Secrets are
    /// read from a file or from stdin (`-`), never from the command line, where any user
    /// could read them in the process list.
    Set {
        /// Its iSCSI name.
        name: String,
        /// Initiator names allowed, replacing the list.
        #[arg(long = "initiator")]
        initiators: Vec<String>,
        /// Any initiator name may log in.
        #[arg(long, conflicts_with = "initiators")]
        any_initiator: bool,
        /// Source networks allowed (CIDR), replacing the list.
        #[arg(long = "network")]
        networks: Vec<String>,
        /// Logins from any address.
        #[arg(long, conflicts_with = "networks")]
        any_network: bool,
        /// SRP initiator port identifiers allowed, replacing the list.
        #[arg(long = "srp-initiator")]
        srp_initiators: Vec<String>,
        /// CHAP: the user name initiators log in with (with --chap-secret-file).
        #[arg(long, requires = "chap_secret_file")]
        chap_user: Option<String>,
        /// CHAP: a file holding the secret (its first line), or `-` for stdin.
        #[arg(long, requires = "chap_user")]
        chap_secret_file: Option<PathBuf>,
        /// No CHAP any more (and no mutual CHAP).
        #[arg(long, conflicts_with_all = ["chap_user", "mutual_user"])]
        no_chap: bool,
        /// Mutual CHAP: the name the target answers with (with --mutual-secret-file).
        #[arg(long, requires = "mutual_secret_file")]
        mutual_user: Option<String>,
        /// Mutual CHAP: a file holding the target's secret, or `-` for stdin.
        #[arg(long, requires = "mutual_user")]
        mutual_secret_file: Option<PathBuf>,
        /// No mutual CHAP any more.
        #[arg(long, conflicts_with = "mutual_user")]
        no_mutual_chap: bool,
    },
    /// Removes a target. Refused while initiators are logged in to it, unless --force.
    Remove {
        /// Its name.
        name: String,
        /// Remove it even while initiators are logged in: their sessions end.
        #[arg(long)]
        force: bool,
    },
}

/// A secret from `path`'s first line, or from stdin's for `-`: never from argv.
fn read_secret(path: &std::path::Path) -> Result<String> {
    let text = if path.as_os_str() == "-" {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line)?;
        line
    } else {
        std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?
    };
    let secret = text.lines().next().unwrap_or_default().to_string();
    if secret.is_empty() {
        anyhow::bail!("{}: no secret on its first line", path.display());
    }
    Ok(secret)
}

#[derive(Subcommand)]
enum SessionAction {
    /// Ends a session.
    Kill {
        /// Its TSIH (see `targetctl sessions`).
        tsih: u16,
    },
}

#[derive(Subcommand)]
enum ConfigAction {
    /// Prints the running config as TOML.
    Dump,
    /// Reads the config file again and applies it (as SIGHUP does). Refused when the file
    /// would drop targets or LUNs made with targetctl since the last save, unless --force.
    Reload {
        /// Drop them.
        #[arg(long)]
        force: bool,
    },
    /// Writes the running config, secrets included, to the file targetd was started with (or
    /// to --to FILE): atomically, mode 0600.
    Save {
        /// Another file to write.
        #[arg(long)]
        to: Option<PathBuf>,
    },
}

struct Client {
    stream: BufReader<UnixStream>,
}

impl Client {
    fn connect(path: &PathBuf) -> Result<Client> {
        let s = UnixStream::connect(path).map_err(|e| {
            let why = match e.kind() {
                // The socket is created mode 0600: only its owner (the user targetd runs as)
                // may use it.
                std::io::ErrorKind::PermissionDenied => "permission denied: the admin socket is \
                     readable and writable only by the user targetd runs as (mode 0600); run \
                     targetctl as that user (often root)"
                    .to_string(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => format!(
                    "{e}: is targetd running, with server.admin_socket = {:?}? (--socket names \
                     another)",
                    path.display().to_string()
                ),
                _ => e.to_string(),
            };
            anyhow::anyhow!("cannot reach targetd at {}: {why}", path.display())
        })?;
        s.set_read_timeout(Some(Duration::from_secs(60)))?;
        Ok(Client {
            stream: BufReader::new(s),
        })
    }

    /// Waits at most `d` for an answer (60 s unless told).
    fn wait_at_most(&mut self, d: Duration) -> Result<()> {
        Ok(self.stream.get_ref().set_read_timeout(Some(d))?)
    }

    fn call(&mut self, req: &AdminRequest) -> Result<Value> {
        let mut line = serde_json::to_vec(req)?;
        line.push(b'\n');
        self.stream.get_mut().write_all(&line)?;
        let mut answer = String::new();
        if self.stream.read_line(&mut answer)? == 0 {
            bail!("targetd closed the connection");
        }
        let r: AdminResponse = serde_json::from_str(&answer).context("targetd's answer")?;
        if !r.ok {
            bail!("{}", r.error.unwrap_or_else(|| "refused".into()));
        }
        Ok(r.result)
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let json = args.json;
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        // With --json an error is data too, on stdout where the answers go.
        Err(e) if json => {
            let error = serde_json::json!({ "error": format!("{e:#}") });
            println!("{error}");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("targetctl: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<()> {
    // Generated from the definitions above, so they cannot drift from what is parsed.
    match args.command {
        Command::Completions { shell } => {
            let cmd = <Args as clap::CommandFactory>::command();
            targetd::manual::print_completions(cmd, shell);
            return Ok(());
        }
        Command::Man { dir } => {
            let cmd = <Args as clap::CommandFactory>::command();
            let pages = targetd::manual::write_man_pages(cmd, &dir)?;
            println!("{} man pages in {}", pages.len(), dir.display());
            return Ok(());
        }
        _ => {}
    }
    let socket = args.socket.clone().unwrap_or_else(|| {
        let here = PathBuf::from("targetd.sock");
        if here.exists() {
            here
        } else {
            PathBuf::from(PACKAGED_SOCKET)
        }
    });
    let mut c = Client::connect(&socket)?;
    let request = match args.command {
        Command::Status => AdminRequest::Status,
        Command::Targets => AdminRequest::Targets,
        Command::Luns { target } => AdminRequest::Luns { target },
        Command::Sessions => AdminRequest::Sessions,
        Command::Subsystems => AdminRequest::Subsystems,
        Command::Cluster { action: None } => AdminRequest::Cluster,
        Command::Cluster {
            action: Some(ClusterAction::Forget { gateway }),
        } => AdminRequest::ClusterForget { gateway },
        // Answered above, without a daemon.
        Command::Completions { .. } | Command::Man { .. } => return Ok(()),
        Command::Stats { interval } => return stats(&mut c, interval, args.json),
        Command::Tree => return tree(&mut c, args.json),
        Command::Lun { action } => match action {
            LunAction::Add { target, lun, unit } => AdminRequest::LunAdd {
                target,
                lun: unit.into_lun(lun)?,
            },
            LunAction::Remove { target, lun, force } => {
                AdminRequest::LunRemove { target, lun, force }
            }
            LunAction::Resize {
                target,
                lun,
                size,
                force,
            } => AdminRequest::LunResize {
                target,
                lun,
                size,
                force,
            },
            LunAction::Fault {
                target,
                lun,
                ops,
                error,
                lba,
                blocks,
                count,
                clear,
            } => {
                let fault = match (clear, ops) {
                    (false, Some(ops)) => Some(serde_json::from_value(serde_json::json!({
                        "ops": ops, "error": error, "lba": lba, "blocks": blocks, "count": count,
                    }))?),
                    _ => None,
                };
                AdminRequest::LunFault { target, lun, fault }
            }
        },
        Command::Subsystem { action } => match action {
            SubsystemAction::Add {
                nqn,
                hosts,
                serial,
                model,
            } => AdminRequest::SubsystemAdd {
                subsystem: config::Subsystem {
                    nqn,
                    serial,
                    model,
                    hosts,
                    namespaces: Vec::new(),
                },
            },
            SubsystemAction::Remove { nqn, force } => AdminRequest::SubsystemRemove { nqn, force },
        },
        Command::Namespace { action } => match action {
            NamespaceAction::Add {
                subsystem,
                nsid,
                unit,
            } => AdminRequest::NamespaceAdd {
                subsystem,
                namespace: config::Namespace {
                    nsid,
                    unit: unit.into_lun(0)?,
                },
            },
            NamespaceAction::Remove {
                subsystem,
                nsid,
                force,
            } => AdminRequest::NamespaceRemove {
                subsystem,
                nsid,
                force,
            },
            NamespaceAction::Resize {
                subsystem,
                nsid,
                size,
                force,
            } => AdminRequest::NamespaceResize {
                subsystem,
                nsid,
                size,
                force,
            },
        },
        Command::Target { action } => match action {
            TargetAction::Add {
                name,
                initiators,
                networks,
                srp_initiators,
            } => AdminRequest::TargetAdd {
                target: config::Target {
                    name,
                    initiators,
                    networks,
                    srp_initiators,
                    chap: None,
                    mutual_chap: None,
                    luns: Vec::new(),
                },
            },
            TargetAction::Set {
                name,
                initiators,
                any_initiator,
                networks,
                any_network,
                srp_initiators,
                chap_user,
                chap_secret_file,
                no_chap,
                mutual_user,
                mutual_secret_file,
                no_mutual_chap,
            } => {
                let list = |v: Vec<String>, any: bool| (any || !v.is_empty()).then_some(v);
                let chap = |user: Option<String>, file: Option<PathBuf>| -> Result<_> {
                    Ok(match (user, file) {
                        (Some(username), Some(f)) => Some(config::Chap {
                            username,
                            secret: read_secret(&f)?,
                        }),
                        _ => None,
                    })
                };
                AdminRequest::TargetSet {
                    name,
                    initiators: list(initiators, any_initiator),
                    networks: list(networks, any_network),
                    srp_initiators: (!srp_initiators.is_empty()).then_some(srp_initiators),
                    chap: chap(chap_user, chap_secret_file)?,
                    mutual_chap: chap(mutual_user, mutual_secret_file)?,
                    no_chap,
                    no_mutual_chap,
                }
            }
            TargetAction::Remove { name, force } => AdminRequest::TargetRemove { name, force },
        },
        Command::Portal { action } => match action {
            PortalAction::Add { address } => AdminRequest::PortalAdd { address },
            PortalAction::Remove { address } => AdminRequest::PortalRemove { address },
        },
        Command::Session {
            action: SessionAction::Kill { tsih },
        } => AdminRequest::SessionKill { tsih },
        Command::Config {
            action: ConfigAction::Dump,
        } => AdminRequest::ConfigDump,
        Command::Config {
            action: ConfigAction::Reload { force },
        } => AdminRequest::Reload { force },
        Command::Config {
            action: ConfigAction::Save { to },
        } => AdminRequest::ConfigSave {
            to: to.map(absolute).transpose()?,
        },
        Command::Trace {
            action:
                TraceAction::Start {
                    out,
                    duration,
                    records,
                },
        } => AdminRequest::TraceStart {
            // The daemon's working directory is not this one's.
            out: std::env::current_dir()?.join(out),
            duration_seconds: duration
                .as_deref()
                .map(parse_duration)
                .transpose()?
                .map(|d| d.as_secs_f64()),
            records_per_reactor: records,
        },
        Command::Trace {
            action: TraceAction::Stop,
        } => AdminRequest::TraceStop,
        Command::Upgrade {
            binary,
            force,
            start_timeout,
            park_timeout,
        } => {
            // The daemon waits for the new binary's start and the park.
            c.wait_at_most(start_timeout + park_timeout + Duration::from_secs(30))?;
            AdminRequest::Upgrade {
                binary: binary.map(absolute).transpose()?,
                force,
                start_timeout_seconds: Some(start_timeout.as_secs_f64()),
                park_timeout_seconds: Some(park_timeout.as_secs_f64()),
            }
        }
    };
    let result = c.call(&request)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&result)?);
        return Ok(());
    }
    print_human(&request, &result);
    Ok(())
}

fn print_human(request: &AdminRequest, v: &Value) {
    match (request, v) {
        (AdminRequest::ConfigDump, Value::String(s)) => print!("{s}"),
        (AdminRequest::Upgrade { .. }, Value::Object(u)) => {
            println!(
                "upgraded: {} (pid {}) serves {} iSCSI session(s) and {} NVMe/TCP \
                 controller(s) handed over; parked in {:.1} ms, initiators paused {:.1} ms",
                text(&u["binary"]),
                u["pid"],
                u["sessions"],
                u["controllers"],
                u["parked_ms"].as_f64().unwrap_or(0.0),
                u["paused_ms"].as_f64().unwrap_or(0.0)
            );
            let aborted = u["aborted_writes"].as_u64().unwrap_or(0);
            if aborted > 0 {
                println!(
                    "{aborted} WRITE(s) still owed their data at the park's deadline: aborted \
                     (TASK ABORTED), for their initiators to send again"
                );
            }
        }
        (AdminRequest::LunFault { .. }, Value::Array(faults)) => {
            if faults.is_empty() {
                println!("no faults armed");
            }
            for f in faults {
                match serde_json::from_value::<backend::Fault>(f.clone()) {
                    Ok(f) => println!("armed: {f}"),
                    Err(_) => println!("armed: {f}"),
                }
            }
        }
        (_, Value::String(s)) => println!("{s}"),
        (AdminRequest::Cluster, Value::Object(c)) => {
            println!(
                "cluster {}, this gateway {} (port group {}){}",
                text(&c["cluster"]),
                text(&c["gateway"]),
                c["port_group"],
                if c["fenced"] == true {
                    ": FENCED, serving no shared unit until it rejoins"
                } else {
                    ""
                }
            );
            let rows = c["members"].as_array().into_iter().flatten().map(|m| {
                let portals = texts(&m["portals"]);
                vec![
                    text(&m["gateway"]),
                    m["port_group"].to_string(),
                    match (m["live"] == true, m["left"] == true) {
                        (true, _) => "live",
                        (false, true) => "left (stopped)",
                        (false, false) => "down",
                    }
                    .to_string(),
                    portals.join(","),
                ]
            });
            print!(
                "{}",
                table(&["GATEWAY", "PORT GROUP", "STATE", "PORTALS"], rows)
            );
            let rows = c["units"].as_array().into_iter().flatten().map(|u| {
                let groups: Vec<String> = u["groups"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|g| {
                        format!(
                            "{} ({}): {}",
                            g["port_group"],
                            g["gateway"].as_str().unwrap_or("?"),
                            text(&g["state"])
                        )
                    })
                    .collect();
                let mut groups = groups.join("; ");
                if let Some(g) = u["chosen_by_initiator"].as_str() {
                    groups += &format!(" ({g} chosen by an initiator)");
                }
                vec![
                    text(&u["target"]),
                    u["lun"].to_string(),
                    text(&u["image"]),
                    groups,
                    u["reservation_holder"].as_str().unwrap_or("-").to_string(),
                ]
            });
            print!(
                "{}",
                table(
                    &[
                        "TARGET",
                        "LUN",
                        "IMAGE",
                        "ALUA STATES",
                        "RESERVATION HOLDER"
                    ],
                    rows
                )
            );
            // Whole targets compared with the cluster's record: the keys that differ.
            let rows = c["targets"].as_array().into_iter().flatten().map(|t| {
                let differences = texts(&t["differences"]);
                vec![
                    text(&t["target"]),
                    text(&t["definition"]),
                    t["recorded_by"].as_str().unwrap_or("-").to_string(),
                    if differences.is_empty() {
                        "-".to_string()
                    } else {
                        differences.join("; ")
                    },
                ]
            });
            print!(
                "{}",
                table(
                    &["TARGET", "DEFINITION", "RECORDED BY", "DIFFERENCES"],
                    rows
                )
            );
        }
        // An empty list says what there is none of (a change that changed nothing says so).
        (AdminRequest::Sessions, Value::Array(v)) if v.is_empty() => println!("no sessions"),
        (AdminRequest::Targets, Value::Array(v)) if v.is_empty() => println!("no targets"),
        (AdminRequest::Subsystems, Value::Array(v)) if v.is_empty() => println!("no subsystems"),
        (AdminRequest::Subsystems, Value::Array(subsystems)) => {
            let rows = subsystems.iter().flat_map(|s| {
                let controllers = s["controllers"].as_array().map_or(0, Vec::len);
                let hosts = s["hosts"].as_array().map_or(0, Vec::len);
                let hosts = if hosts == 0 {
                    "any".to_string()
                } else {
                    hosts.to_string()
                };
                let namespaces: Vec<Value> =
                    s["namespaces"].as_array().cloned().unwrap_or_default();
                let first = std::iter::once(vec![
                    text(&s["nqn"]),
                    hosts,
                    controllers.to_string(),
                    String::new(),
                    String::new(),
                    String::new(),
                ]);
                first.chain(namespaces.into_iter().map(|n| {
                    let backing = n["path"]
                        .as_str()
                        .or(n["image"].as_str())
                        .map_or_else(|| text(&n["backend"]), str::to_string);
                    let size = n["bytes"]
                        .as_u64()
                        .map(units::format_size)
                        .unwrap_or_default();
                    vec![
                        String::new(),
                        String::new(),
                        String::new(),
                        n["nsid"].to_string(),
                        backing,
                        format!("{size} ({} B blocks)", n["block_size"]),
                    ]
                }))
            });
            let headers = [
                "SUBSYSTEM",
                "HOSTS",
                "CONTROLLERS",
                "NSID",
                "STORAGE",
                "SIZE",
            ];
            print!("{}", table(&headers, rows));
        }
        (AdminRequest::Luns { .. }, Value::Array(v)) if v.is_empty() => println!("no LUNs"),
        (_, Value::Array(changes)) if changes.iter().all(Value::is_string) => {
            if changes.is_empty() {
                println!("no change");
            }
            for c in changes {
                println!("{}", c.as_str().unwrap_or_default());
            }
        }
        (AdminRequest::Status, Value::Object(o)) => {
            let list = |k: &str| {
                let items: Vec<String> = o
                    .get(k)
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .map(text)
                    .collect();
                (!items.is_empty()).then(|| items.join(", "))
            };
            let field = |k: &str| o.get(k).filter(|v| !v.is_null()).map(text);
            let uptime = o
                .get("uptime_seconds")
                .and_then(Value::as_u64)
                .map(|s| units::format_duration(Duration::from_secs(s)));
            let rows = [
                ("version", field("version")),
                ("pid", field("pid")),
                ("uptime", uptime),
                ("engine", field("engine")),
                ("iSCSI portals", list("portals")),
                ("iSER portals", list("iser_portals")),
                ("SRP portals", list("srp_portals")),
                ("NVMe/TCP portals", list("nvme_portals")),
                ("NVMe/RDMA portals", list("nvme_rdma_portals")),
                ("NVMe discovery", list("nvme_discovery_portals")),
                ("cluster gateway", field("cluster_gateway")),
                ("targets", field("targets")),
                ("subsystems", field("subsystems")),
                ("NVMe controllers", field("nvme_controllers")),
                ("sessions", field("sessions")),
                ("connections", field("connections")),
                ("config", field("config")),
                ("admin socket", field("admin_socket")),
            ];
            let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
            for (k, v) in rows {
                if let Some(v) = v {
                    println!("{k:<width$}  {v}");
                }
            }
        }
        (AdminRequest::Targets, Value::Array(targets)) => {
            let rows = targets.iter().map(|t| {
                let luns: Vec<String> = t["luns"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|l| l.to_string())
                    .collect();
                vec![
                    text(&t["name"]),
                    luns.join(","),
                    t["sessions"].to_string(),
                    text(&t["srp_port_id"]),
                ]
            });
            // The core lock's acquisitions are in --json and the metrics, for developers.
            let headers = ["TARGET", "LUNS", "SESSIONS", "SRP PORT ID"];
            print!("{}", table(&headers, rows));
        }
        (AdminRequest::Luns { .. }, Value::Array(luns)) => {
            let rows = luns.iter().map(|l| {
                let backing = match (&l["rbd"], l["path"].as_str()) {
                    (Value::Object(r), _) => format!(
                        "rbd:{}/{}",
                        r.get("pool").map(text).unwrap_or_default(),
                        r.get("image").map(text).unwrap_or_default()
                    ),
                    (_, Some(path)) => path.to_string(),
                    _ => "-".to_string(),
                };
                let mut flags = Vec::new();
                if l["thin"] == true {
                    flags.push("thin");
                }
                if l["read_only"] == true {
                    flags.push("read-only");
                }
                if l["write_cache"] == true {
                    flags.push("write-cache");
                }
                if l["faults"].as_array().is_some_and(|f| !f.is_empty()) {
                    flags.push("FAULTS ARMED");
                }
                vec![
                    text(&l["target"]),
                    l["lun"].to_string(),
                    text(&l["backend"]),
                    l["size"]
                        .as_u64()
                        .map(units::format_size)
                        .unwrap_or_default(),
                    l["block_size"].to_string(),
                    backing,
                    flags.join(","),
                ]
            });
            let headers = [
                "TARGET", "LUN", "BACKEND", "SIZE", "BLOCK", "BACKING", "FLAGS",
            ];
            print!("{}", table(&headers, rows));
            // An RBD unit's image and librbd's figures, under the table.
            for l in luns {
                if let Value::Object(r) = &l["rbd"] {
                    let k: Vec<String> =
                        r.iter().map(|(k, v)| format!("{k}={}", text(v))).collect();
                    println!(
                        "{} lun {} rbd: {}",
                        text(&l["target"]),
                        l["lun"],
                        k.join(" ")
                    );
                }
            }
        }
        (AdminRequest::Sessions, Value::Array(sessions)) => {
            for s in sessions {
                if s["transport"] == "srp" {
                    println!(
                        "srp {} -> {} (target port {})",
                        s["initiator"].as_str().unwrap_or_default(),
                        s["target"].as_str().unwrap_or_default(),
                        s["target_port_id"].as_str().unwrap_or_default()
                    );
                    for c in s["channels"].as_array().into_iter().flatten() {
                        println!(
                            "  channel on {} reactor {}: request limit {}, IU lengths {}/{}",
                            c["portal"].as_str().unwrap_or_default(),
                            c["reactor"],
                            c["request_limit"],
                            c["max_it_iu_len"],
                            c["max_ti_iu_len"]
                        );
                    }
                    continue;
                }
                println!(
                    "tsih {} {} -> {} (isid {})",
                    s["tsih"],
                    s["initiator"].as_str().unwrap_or_default(),
                    s["target"].as_str().unwrap_or_default(),
                    s["isid"].as_str().unwrap_or_default()
                );
                for c in s["connections"].as_array().into_iter().flatten() {
                    println!(
                        "  cid {} from {} over {} on reactor {}: HeaderDigest={} DataDigest={} MaxRecvDataSegmentLength={}/{}",
                        c["cid"], c["peer"].as_str().unwrap_or_default(),
                        c["transport"].as_str().unwrap_or("tcp"), c["reactor"],
                        c["header_digest"].as_str().unwrap_or_default(),
                        c["data_digest"].as_str().unwrap_or_default(),
                        c["max_recv_data_segment_length"], c["initiator_max_recv_data_segment_length"]
                    );
                }
                if let Some(keys) = s["keys"].as_object() {
                    let k: Vec<String> = keys.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    println!("  {}", k.join(" "));
                }
            }
        }
        (_, Value::Array(rows)) => {
            for r in rows {
                if let Some(o) = r.as_object() {
                    let k: Vec<String> = o.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    println!("{}", k.join(" "));
                }
            }
        }
        (AdminRequest::TraceStop, Value::Object(o)) => {
            for (k, v) in o {
                println!("{k}: {v}");
            }
            let dropped = o.get("dropped").and_then(Value::as_u64).unwrap_or(0);
            if dropped > 0 {
                let kept = o.get("records").and_then(Value::as_u64).unwrap_or(0);
                let share = 100 * dropped / (kept + dropped).max(1);
                println!(
                    "WARNING: {dropped} records ({share}%) were dropped: the rings filled; \
                     trace start --records N keeps more per reactor"
                );
            }
        }
        (_, Value::Object(o)) => {
            for (k, v) in o {
                println!("{k}: {v}");
            }
        }
        (_, other) => println!("{other}"),
    }
}

/// A JSON string's text (other values as JSON).
fn text(v: &Value) -> String {
    v.as_str().map_or_else(|| v.to_string(), str::to_string)
}

/// Each item of an array as [`text`]; none for anything else.
fn texts(v: &Value) -> Vec<String> {
    v.as_array().into_iter().flatten().map(text).collect()
}

/// Rows under a header line, each column as wide as its widest cell, two spaces apart (the
/// last column unpadded).
fn table(headers: &[&str], rows: impl IntoIterator<Item = Vec<String>>) -> String {
    let rows: Vec<Vec<String>> = rows.into_iter().collect();
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for r in &rows {
        for (w, cell) in widths.iter_mut().zip(r) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let last = cells.len().saturating_sub(1);
        let mut out = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i == last {
                out.push_str(cell);
            } else {
                out.push_str(&format!("{cell:<w$}  "));
            }
        }
        out.trim_end().to_string() + "\n"
    };
    let mut out = line(headers.to_vec());
    for r in &rows {
        out += &line(r.iter().map(String::as_str).collect());
    }
    out
}

/// The tree of every target, from the running config (`config dump`), the daemon's portals
/// (`status`) and its units (`luns`: their sizes as they run).
fn tree(c: &mut Client, json: bool) -> Result<()> {
    let status = c.call(&AdminRequest::Status)?;
    let dump = c.call(&AdminRequest::ConfigDump)?;
    let luns = c.call(&AdminRequest::Luns { target: None })?;
    let config: toml::Table = toml::from_str(dump.as_str().unwrap_or_default())?;
    let server = config.get("server").and_then(|v| v.as_table());
    let list = |key: &str| toml_strings(server.and_then(|s| s.get(key)));
    let labelled = |portals: Vec<String>, kind: &str| -> Vec<String> {
        portals
            .into_iter()
            .map(|p| format!("{p} ({kind})"))
            .collect()
    };
    let mut portals = labelled(strings(&status["portals"]), "iSCSI");
    portals.extend(labelled(list("iser_portals"), "iSER"));
    portals.extend(labelled(list("rdma_portals"), "SRP"));
    let targets = config.get("targets").and_then(|v| v.as_array());
    let mut out = Vec::new();
    for t in targets.into_iter().flatten() {
        let name = t.get("name").and_then(|v| v.as_str()).unwrap_or_default();
        let (initiators, networks, srp) = (
            toml_strings(t.get("initiators")),
            toml_strings(t.get("networks")),
            toml_strings(t.get("srp_initiators")),
        );
        let user = |key: &str| {
            t.get(key)
                .and_then(|c| c.get("username"))
                .and_then(|u| u.as_str())
                .map(str::to_string)
        };
        let units: Vec<Value> = luns
            .as_array()
            .into_iter()
            .flatten()
            .filter(|l| l["target"] == name)
            .cloned()
            .collect();
        out.push(serde_json::json!({
            "target": name,
            "portals": portals,
            "initiators": initiators,
            "networks": networks,
            "srp_initiators": srp,
            "chap_user": user("chap"),
            "mutual_chap_user": user("mutual_chap"),
            "luns": units,
        }));
    }
    // NVM subsystems follow the targets: their portals, who may connect, the controllers
    // connected with their I/O queues, the namespaces.
    let mut nvme_portals = labelled(strings(&status["nvme_portals"]), "NVMe/TCP");
    nvme_portals.extend(labelled(list("nvme_rdma_portals"), "NVMe/RDMA"));
    let subsystems = c.call(&AdminRequest::Subsystems)?;
    for sub in subsystems.as_array().into_iter().flatten() {
        out.push(serde_json::json!({
            "subsystem": sub["nqn"],
            "portals": nvme_portals,
            "hosts": sub["hosts"],
            "controllers": sub["controllers"],
            "namespaces": sub["namespaces"],
        }));
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    if out.is_empty() {
        println!("no targets or subsystems");
    }
    let (targets, subsystems): (Vec<&Value>, Vec<&Value>) =
        out.iter().partition(|t| t.get("target").is_some());
    let out = targets;
    for t in &out {
        println!("{}", text(&t["target"]));
        print_portals(&t["portals"]);
        let (initiators, networks) = (strings(&t["initiators"]), strings(&t["networks"]));
        let access = match (initiators.is_empty(), networks.is_empty()) {
            (true, true) => "any initiator".to_string(),
            (false, true) => format!("initiators {}", initiators.join(", ")),
            (true, false) => format!("networks {}", networks.join(", ")),
            (false, false) => format!(
                "initiators {}; networks {}",
                initiators.join(", "),
                networks.join(", ")
            ),
        };
        println!("├── access: {access}");
        let srp = strings(&t["srp_initiators"]);
        if !srp.is_empty() {
            println!("├── SRP initiator ports: {}", srp.join(", "));
        }
        let chap = match (t["chap_user"].as_str(), t["mutual_chap_user"].as_str()) {
            (None, _) => "none".to_string(),
            (Some(u), None) => format!("user {u}"),
            (Some(u), Some(m)) => format!("user {u}, mutual as {m}"),
        };
        println!("├── CHAP: {chap}");
        let luns = t["luns"].as_array().cloned().unwrap_or_default();
        println!("└── LUNs{}", if luns.is_empty() { ": none" } else { "" });
        for (i, l) in luns.iter().enumerate() {
            let branch = branch(i, luns.len());
            let backing = match (&l["rbd"], l["path"].as_str()) {
                (Value::Object(r), _) => format!(
                    "rbd {}/{}",
                    r.get("pool").map(text).unwrap_or_default(),
                    r.get("image").map(text).unwrap_or_default()
                ),
                (_, Some(path)) => format!("{} {path}", text(&l["backend"])),
                _ => text(&l["backend"]),
            };
            println!(
                "    {branch} {}: {backing}, {}, {}-byte blocks",
                l["lun"],
                l["size"]
                    .as_u64()
                    .map(units::format_size)
                    .unwrap_or_default(),
                l["block_size"]
            );
        }
    }
    for s in subsystems {
        print_subsystem(s);
    }
    Ok(())
}

/// The items of JSON array `v` as text (none when it is not one).
fn strings(v: &Value) -> Vec<String> {
    v.as_array().into_iter().flatten().map(text).collect()
}

/// The strings of TOML array `v` (none when absent or not one).
fn toml_strings(v: Option<&toml::Value>) -> Vec<String> {
    v.and_then(|v| v.as_array())
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect()
}

/// A tree's portals line.
fn print_portals(portals: &Value) {
    let portals = strings(portals);
    println!(
        "├── portals: {}",
        if portals.is_empty() {
            "none".into()
        } else {
            portals.join(", ")
        }
    );
}

/// The tree's branch to item `i` of `len`: the last one closes the branch.
fn branch(i: usize, len: usize) -> &'static str {
    if i + 1 == len {
        "└──"
    } else {
        "├──"
    }
}

/// One NVM subsystem of `targetctl tree`.
fn print_subsystem(s: &Value) {
    println!("{}", text(&s["subsystem"]));
    print_portals(&s["portals"]);
    let hosts = strings(&s["hosts"]);
    if hosts.is_empty() {
        println!("├── access: any host");
    } else {
        println!("├── access: hosts {}", hosts.join(", "));
    }
    let controllers = s["controllers"].as_array().cloned().unwrap_or_default();
    println!(
        "├── controllers{}",
        if controllers.is_empty() { ": none" } else { "" }
    );
    for (i, c) in controllers.iter().enumerate() {
        let branch = branch(i, controllers.len());
        let queues = strings(&c["io_queues"]);
        println!(
            "│   {branch} {}: {}, I/O queues {}",
            c["cntlid"],
            text(&c["host"]),
            if queues.is_empty() {
                "none".into()
            } else {
                queues.join(", ")
            }
        );
    }
    let namespaces = s["namespaces"].as_array().cloned().unwrap_or_default();
    println!(
        "└── namespaces{}",
        if namespaces.is_empty() { ": none" } else { "" }
    );
    for (i, n) in namespaces.iter().enumerate() {
        let branch = branch(i, namespaces.len());
        let backing = n["path"].as_str().or(n["image"].as_str()).map_or_else(
            || text(&n["backend"]),
            |b| format!("{} {b}", text(&n["backend"])),
        );
        println!(
            "    {branch} {}: {backing}, {}, {}-byte blocks",
            n["nsid"],
            n["bytes"]
                .as_u64()
                .map(units::format_size)
                .unwrap_or_default(),
            n["block_size"]
        );
    }
}

/// Samples the counters twice and prints rates.
fn stats(c: &mut Client, interval: Duration, json: bool) -> Result<()> {
    let first = c.call(&AdminRequest::Stats)?;
    if interval.is_zero() {
        if json {
            println!("{}", serde_json::to_string_pretty(&first)?);
            return Ok(());
        }
        // Totals since the start, each with its unit.
        let rows = first.as_array().into_iter().flatten().map(|l| {
            let n = |k: &str| l[k].as_u64().unwrap_or(0);
            let mean = |ns: &str, count: &str| match n(count) {
                0 => "-".to_string(),
                c => units::format_duration(Duration::from_nanos(n(ns) / c)),
            };
            vec![
                text(&l["target"]),
                n("lun").to_string(),
                n("read_commands").to_string(),
                units::format_size(n("read_bytes")),
                mean("read_latency_ns", "read_commands"),
                n("write_commands").to_string(),
                units::format_size(n("write_bytes")),
                mean("write_latency_ns", "write_commands"),
                n("other_commands").to_string(),
                n("errors").to_string(),
            ]
        });
        let headers = [
            "TARGET",
            "LUN",
            "READS",
            "READ",
            "MEAN READ",
            "WRITES",
            "WRITTEN",
            "MEAN WRITE",
            "OTHER",
            "ERRORS",
        ];
        print!("{}", table(&headers, rows));
        return Ok(());
    }
    std::thread::sleep(interval);
    let interval = interval.as_secs_f64();
    let second = c.call(&AdminRequest::Stats)?;
    let mut rows = Vec::new();
    for b in second.as_array().into_iter().flatten() {
        let a = first
            .as_array()
            .into_iter()
            .flatten()
            .find(|a| a["target"] == b["target"] && a["lun"] == b["lun"]);
        let d = |k: &str| b[k].as_u64().unwrap_or(0) - a.and_then(|a| a[k].as_u64()).unwrap_or(0);
        let (r, w) = (d("read_commands"), d("write_commands"));
        let lat = |ns: u64, n: u64| {
            if n == 0 {
                0.0
            } else {
                ns as f64 / n as f64 / 1000.0
            }
        };
        rows.push(serde_json::json!({
            "target": b["target"],
            "lun": b["lun"],
            "read_iops": r as f64 / interval,
            "write_iops": w as f64 / interval,
            "read_mib_s": d("read_bytes") as f64 / interval / (1 << 20) as f64,
            "write_mib_s": d("write_bytes") as f64 / interval / (1 << 20) as f64,
            "read_latency_us": lat(d("read_latency_ns"), r),
            "write_latency_us": lat(d("write_latency_ns"), w),
            "errors": d("errors"),
        }));
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!(
        "{:<40} {:>4} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9}",
        "target",
        "lun",
        "read IOPS",
        "write IOPS",
        "read MiB/s",
        "write MiB/s",
        "rd lat us",
        "wr lat us"
    );
    for r in rows {
        println!(
            "{:<40} {:>4} {:>10.0} {:>10.0} {:>10.1} {:>10.1} {:>9.1} {:>9.1}",
            r["target"].as_str().unwrap_or_default(),
            r["lun"],
            r["read_iops"].as_f64().unwrap_or(0.0),
            r["write_iops"].as_f64().unwrap_or(0.0),
            r["read_mib_s"].as_f64().unwrap_or(0.0),
            r["write_mib_s"].as_f64().unwrap_or(0.0),
            r["read_latency_us"].as_f64().unwrap_or(0.0),
            r["write_latency_us"].as_f64().unwrap_or(0.0),
        );
    }
    Ok(())
}
