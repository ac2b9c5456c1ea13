//! The admin interface: a Unix socket (mode 0600) speaking one JSON object per line, used by
//! `targetctl`. (The Prometheus endpoint is [`crate::metrics`].)
//!
//! Every change (LUN or target added, removed, resized; reload) is made to a copy of the
//! running config, validated as a whole and applied through [`Registry::apply`], so the running
//! config that `config dump` prints is always one the daemon would accept at start.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use crate::config::{self, Config};
use crate::lock;
use crate::registry::Registry;
use crate::trace::Tracer;

/// A request to the daemon.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "kebab-case", deny_unknown_fields)]
pub enum AdminRequest {
    /// Version, uptime, portals, engine, counts.
    Status,
    /// Targets with their LUNs and session counts.
    Targets,
    /// Logical units, of one target or all.
    Luns {
        /// The target; all when absent.
        #[serde(default)]
        target: Option<String>,
    },
    /// Sessions with their connections and negotiated keys.
    Sessions,
    /// NVM subsystems: their namespaces and the controllers connected.
    Subsystems,
    /// Per-LU counters.
    Stats,
    /// Adds a logical unit.
    LunAdd {
        /// The target.
        target: String,
        /// The unit, as in the config file.
        lun: config::Lun,
    },
    /// Removes a logical unit.
    LunRemove {
        /// The target.
        target: String,
        /// The LUN.
        lun: u16,
        /// Also while initiators are logged in to its target (they lose it).
        #[serde(default)]
        force: bool,
    },
    /// Resizes a logical unit (initiators see CAPACITY DATA HAS CHANGED).
    LunResize {
        /// The target.
        target: String,
        /// The LUN.
        lun: u16,
        /// The new size ("2GiB", bytes).
        size: String,
        /// Allow a smaller size: the blocks past it are cut off.
        #[serde(default)]
        force: bool,
    },
    /// Exports an NVM subsystem (with the namespaces it names); the discovery log lists it.
    SubsystemAdd {
        /// The subsystem, as in the config file.
        subsystem: config::Subsystem,
    },
    /// Stops exporting an NVM subsystem: its connections close.
    SubsystemRemove {
        /// Its NQN.
        nqn: String,
        /// Also while controllers are connected (their hosts lose it).
        #[serde(default)]
        force: bool,
    },
    /// Adds a namespace to a subsystem; its controllers hear of it.
    NamespaceAdd {
        /// The subsystem's NQN.
        subsystem: String,
        /// The namespace, as in the config file.
        namespace: config::Namespace,
    },
    /// Removes a namespace from a subsystem.
    NamespaceRemove {
        /// The subsystem's NQN.
        subsystem: String,
        /// The NSID.
        nsid: u32,
        /// Also while controllers are connected (their hosts lose it).
        #[serde(default)]
        force: bool,
    },
    /// Resizes a namespace; its controllers hear of it.
    NamespaceResize {
        /// The subsystem's NQN.
        subsystem: String,
        /// The NSID.
        nsid: u32,
        /// The new size ("2GiB", bytes).
        size: String,
        /// Allow a smaller size: the blocks past it are cut off.
        #[serde(default)]
        force: bool,
    },
    /// Arms a fault on a logical unit (its operations fail as a failing disk's would), or
    /// clears them all when `fault` is absent. Answers with the faults armed after.
    LunFault {
        /// The target.
        target: String,
        /// The LUN.
        lun: u16,
        /// The fault to arm; none clears every fault of the unit.
        #[serde(default)]
        fault: Option<backend::Fault>,
    },
    /// The cluster of gateways: members, liveness, each shared unit's ALUA states.
    Cluster,
    /// Takes a gateway that is gone for good out of the cluster.
    ClusterForget {
        /// Its `cluster.gateway`.
        gateway: String,
    },
    /// Adds a target.
    TargetAdd {
        /// The target, as in the config file.
        target: config::Target,
    },
    /// Changes a target's access rules for new logins: what is given replaces what is set.
    TargetSet {
        /// Its name.
        name: String,
        /// Initiator names allowed (empty: any).
        #[serde(default)]
        initiators: Option<Vec<String>>,
        /// Source networks allowed, CIDR (empty: any).
        #[serde(default)]
        networks: Option<Vec<String>>,
        /// SRP initiator port identifiers allowed (empty: any).
        #[serde(default)]
        srp_initiators: Option<Vec<String>>,
        /// CHAP the initiator must pass from now on.
        #[serde(default)]
        chap: Option<config::Chap>,
        /// Mutual CHAP from now on.
        #[serde(default)]
        mutual_chap: Option<config::Chap>,
        /// No CHAP any more (nor mutual CHAP).
        #[serde(default)]
        no_chap: bool,
        /// No mutual CHAP any more.
        #[serde(default)]
        no_mutual_chap: bool,
    },
    /// Removes a target.
    TargetRemove {
        /// Its name.
        name: String,
        /// Also while initiators are logged in to it: their sessions end.
        #[serde(default)]
        force: bool,
    },
    /// Listens on one more iSCSI portal, at once.
    PortalAdd {
        /// `host:port` (port 0: any free port).
        address: String,
    },
    /// Stops listening on a portal (its connections stay); not the last one.
    PortalRemove {
        /// As it was added, or the address it listens on.
        address: String,
    },
    /// Ends a session.
    SessionKill {
        /// Its TSIH.
        tsih: u16,
    },
    /// The running config, as TOML.
    ConfigDump,
    /// Writes the running config (secrets included) to `to`, or to the file the daemon was
    /// started with: a temporary file in the same directory, synced, renamed over, mode 0600.
    ConfigSave {
        /// An absolute path; the daemon's config file when absent.
        #[serde(default)]
        to: Option<PathBuf>,
    },
    /// Reads the config file again and applies it (as SIGHUP does); refused when it would
    /// drop targets or LUNs made live since the last save, unless `force`.
    Reload {
        /// Drop them.
        #[serde(default)]
        force: bool,
    },
    /// Starts tracing every command's stages into `out` (the daemon writes it at the stop).
    TraceStart {
        /// The trace file, an absolute path (the daemon's working directory is not the
        /// caller's).
        out: PathBuf,
        /// Stop by itself after this many seconds.
        #[serde(default)]
        duration_seconds: Option<f64>,
        /// Records each reactor keeps (default `trace::RECORDS_PER_REACTOR`); once its ring
        /// is full a reactor drops the rest, and says so.
        #[serde(default)]
        records_per_reactor: Option<usize>,
    },
    /// Stops the trace and writes its file.
    TraceStop,
    /// Hands every listening socket and iSCSI/TCP session to a new targetd binary, which
    /// serves on; this daemon then exits ([`crate::upgrade`]). On any failure this daemon
    /// serves on as before.
    Upgrade {
        /// The new binary (absolute); the one running when absent.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        binary: Option<PathBuf>,
        /// Also when memory units would come up empty or unsaved changes would be lost.
        #[serde(default)]
        force: bool,
        /// Seconds the new binary may take to start (60 when absent).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        start_timeout_seconds: Option<f64>,
        /// Seconds the sessions may take to finish their commands and park (10 when absent).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        park_timeout_seconds: Option<f64>,
    },
}

/// The daemon's answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AdminResponse {
    /// Whether it worked.
    pub ok: bool,
    /// The result.
    #[serde(default)]
    pub result: Value,
    /// Why it did not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Binds the admin socket, mode 0600. A stale socket file is replaced; one a running daemon
/// answers on is refused.
pub fn bind(path: &Path) -> Result<Option<(std::os::unix::net::UnixListener, PathBuf)>, String> {
    if path.as_os_str().is_empty() {
        return Ok(None);
    }
    match existing_socket(path)? {
        Some(true) => {
            return Err(format!("{} is in use by a running targetd", path.display()));
        }
        Some(false) => {
            std::fs::remove_file(path).map_err(|e| format!("{}: {e}", path.display()))?;
        }
        None => {}
    }
    let l = std::os::unix::net::UnixListener::bind(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    l.set_nonblocking(true)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(Some((l, path.to_path_buf())))
}

/// What is at the admin socket's `path` already: nothing (`None`), a socket a running
/// targetd answers on (`Some(true)`), a socket nobody answers on, left by a daemon that ended
/// (`Some(false)`); anything else is refused.
pub fn existing_socket(path: &Path) -> Result<Option<bool>, String> {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(None);
    };
    if !meta.file_type().is_socket() {
        return Err(format!("{} exists and is not a socket", path.display()));
    }
    Ok(Some(std::os::unix::net::UnixStream::connect(path).is_ok()))
}

/// Serves admin clients.
pub async fn serve(listener: UnixListener, registry: Arc<Registry>, tracer: Arc<Tracer>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let (registry, tracer) = (registry.clone(), tracer.clone());
        tokio::spawn(async move {
            if let Err(e) = client(stream, &registry, &tracer).await {
                tracing::debug!("admin client: {e}");
            }
        });
    }
}

/// Carries out a request, the trace's on the reactors' tracer.
fn handle_with(
    registry: &Registry,
    tracer: &Arc<Tracer>,
    req: AdminRequest,
) -> Result<Value, String> {
    match req {
        AdminRequest::TraceStart {
            out,
            duration_seconds,
            records_per_reactor,
        } => {
            if !out.is_absolute() {
                return Err(format!(
                    "{}: the trace file's path must be absolute",
                    out.display()
                ));
            }
            let duration = match duration_seconds {
                Some(s) if !(s > 0.0 && s <= 86_400.0) => {
                    return Err(format!("duration {s} s is outside (0, 86400]"));
                }
                Some(s) => Some(Duration::from_secs_f64(s)),
                None => None,
            };
            let max = crate::trace::MAX_RECORDS_PER_REACTOR;
            let records = match records_per_reactor {
                Some(n) if !(1024..=max).contains(&n) => {
                    return Err(format!("{n} records per reactor is outside 1024..={max}"));
                }
                Some(n) => n,
                None => crate::trace::RECORDS_PER_REACTOR,
            };
            tracer.start(out, duration, records)
        }
        AdminRequest::TraceStop => tracer.stop(),
        other => handle(registry, other),
    }
}

impl AdminRequest {
    /// The request as the audit log shows it: its JSON, as targetctl sent it, with every CHAP
    /// secret replaced by [`REDACTED`](crate::config::REDACTED).
    pub fn audit_text(&self) -> String {
        fn redact(v: &mut Value) {
            match v {
                Value::Object(o) => {
                    for (k, v) in o.iter_mut() {
                        if k == "secret" {
                            *v = Value::String(crate::config::REDACTED.into());
                        } else {
                            redact(v);
                        }
                    }
                }
                Value::Array(a) => a.iter_mut().for_each(redact),
                _ => {}
            }
        }
        let mut v = serde_json::to_value(self).unwrap_or(Value::Null);
        redact(&mut v);
        v.to_string()
    }

    /// Whether it changes anything (and so is logged with who asked).
    pub fn is_change(&self) -> bool {
        !matches!(
            self,
            AdminRequest::Status
                | AdminRequest::Targets
                | AdminRequest::Luns { .. }
                | AdminRequest::Sessions
                | AdminRequest::Subsystems
                | AdminRequest::Stats
                | AdminRequest::ConfigDump
                | AdminRequest::Cluster
        )
    }
}

async fn client(
    stream: UnixStream,
    registry: &Registry,
    tracer: &Arc<Tracer>,
) -> std::io::Result<()> {
    // Who asks: every change is logged with the peer's uid (and pid), from the socket's
    // credentials, not from anything the client says.
    let (uid, pid) = stream
        .peer_cred()
        .map(|c| (Some(c.uid()), c.pid()))
        .unwrap_or((None, None));
    let (rd, mut wr) = stream.into_split();
    let mut lines = BufReader::new(rd).lines();
    while let Some(line) = lines.next_line().await? {
        let mut upgraded = false;
        let response = match serde_json::from_str::<AdminRequest>(&line) {
            Ok(req) => {
                let what = req.is_change().then(|| req.audit_text());
                let result = match req {
                    AdminRequest::Upgrade {
                        binary,
                        force,
                        start_timeout_seconds,
                        park_timeout_seconds,
                    } => {
                        let result = upgrade(
                            registry,
                            binary,
                            force,
                            start_timeout_seconds,
                            park_timeout_seconds,
                        )
                        .await;
                        upgraded = result.is_ok();
                        result
                    }
                    req => handle_with(registry, tracer, req),
                };
                if let Some(what) = what {
                    match &result {
                        Ok(changes) => tracing::info!(
                            uid,
                            pid,
                            request = %what,
                            changes = %changes,
                            "admin change"
                        ),
                        Err(e) => tracing::warn!(
                            uid,
                            pid,
                            request = %what,
                            "admin change refused: {e}"
                        ),
                    }
                }
                match result {
                    Ok(result) => AdminResponse {
                        ok: true,
                        result,
                        error: None,
                    },
                    Err(e) => AdminResponse {
                        ok: false,
                        result: Value::Null,
                        error: Some(e),
                    },
                }
            }
            Err(e) => AdminResponse {
                ok: false,
                result: Value::Null,
                error: Some(format!("bad request: {e}")),
            },
        };
        let mut out = serde_json::to_vec(&response).unwrap_or_default();
        out.push(b'\n');
        let written = wr.write_all(&out).await;
        if upgraded {
            // Answered (or the asker left): the successor serves, this daemon stops.
            registry.succession.succeed();
        }
        written?;
    }
    Ok(())
}

/// `targetctl upgrade`: the options checked, then [`crate::upgrade::upgrade`].
async fn upgrade(
    registry: &Registry,
    binary: Option<PathBuf>,
    force: bool,
    start_timeout: Option<f64>,
    park_timeout: Option<f64>,
) -> Result<Value, String> {
    let seconds = |s: Option<f64>, default: Duration, what: &str| match s {
        None => Ok(default),
        Some(s) if s > 0.0 && s <= 3600.0 => Ok(Duration::from_secs_f64(s)),
        Some(s) => Err(format!("{what} {s} s is outside (0, 3600]")),
    };
    if let Some(b) = binary.as_ref().filter(|b| !b.is_absolute()) {
        return Err(format!(
            "{}: the binary's path must be absolute",
            b.display()
        ));
    }
    let defaults = crate::upgrade::UpgradeOptions::default();
    let options = crate::upgrade::UpgradeOptions {
        binary,
        force,
        start_within: seconds(start_timeout, defaults.start_within, "start timeout")?,
        park_within: seconds(park_timeout, defaults.park_within, "park timeout")?,
    };
    crate::upgrade::upgrade(registry, options)
        .await
        .map(|u| json!(u))
        .map_err(|e| e.to_string())
}

/// Runs one request.
pub fn handle(registry: &Registry, req: AdminRequest) -> Result<Value, String> {
    match req {
        AdminRequest::Status => Ok(status(registry)),
        AdminRequest::Targets => Ok(targets(registry)),
        AdminRequest::Luns { target } => luns(registry, target.as_deref()),
        AdminRequest::Sessions => Ok(sessions_json(registry)),
        AdminRequest::Subsystems => Ok(subsystems(registry)),
        AdminRequest::Cluster => cluster(registry, None),
        AdminRequest::ClusterForget { gateway } => cluster(registry, Some(&gateway)),
        AdminRequest::Stats => Ok(stats(registry)),
        AdminRequest::ConfigDump => {
            let config = registry.config().redacted();
            let text = toml::to_string(&config).map_err(|e| e.to_string())?;
            Ok(Value::String(format!(
                "{}{text}",
                waiting_for_restart(&registry.started_server, &config.server)
            )))
        }
        AdminRequest::Reload { force } => registry.reload(force).map(|c| json!(c)),
        AdminRequest::LunFault { target, lun, fault } => {
            let t = registry
                .target(&target)
                .ok_or(format!("no target {target}"))?;
            let unit = t.lun(lun).ok_or(format!("{target} has no LUN {lun}"))?;
            match fault {
                Some(f) => {
                    tracing::warn!(target = %target, lun, "fault armed: {f}");
                    unit.faults.arm(f);
                }
                None => {
                    tracing::info!(target = %target, lun, "faults cleared");
                    unit.faults.clear();
                }
            }
            Ok(json!(unit.faults.armed()))
        }
        AdminRequest::TraceStart { .. } | AdminRequest::TraceStop => {
            Err("traces are started and stopped through the admin socket".into())
        }
        AdminRequest::Upgrade { .. } => {
            Err("an upgrade runs through the admin socket (crate::upgrade::upgrade)".into())
        }
        AdminRequest::SessionKill { tsih } => {
            let s = registry
                .sessions
                .get(tsih)
                .ok_or(format!("no session with TSIH {tsih}"))?;
            registry.sessions.close(&s);
            Ok(json!(format!("session {tsih} closed")))
        }
        AdminRequest::ConfigSave { to } => {
            let path = match to {
                Some(p) if !p.is_absolute() => {
                    return Err(format!("{}: the path must be absolute", p.display()))
                }
                Some(p) => p,
                None => registry.config_path.clone(),
            };
            let notes = save(registry, &path)?;
            let mut said = format!("saved to {}", path.display());
            for note in notes {
                said.push_str("; ");
                said.push_str(&note);
            }
            Ok(json!(said))
        }
        other => change(registry, other),
    }
}

/// Comment lines naming the `[server]` values a reload changed that take effect only at the
/// next start (what runs is `started`); empty when there are none.
fn waiting_for_restart(started: &config::Server, now: &config::Server) -> String {
    started
        .restart_only_differences(now)
        .into_iter()
        .map(|(key, then, now)| {
            format!("# waiting for a restart: server.{key} = {now} (running with {then})\n")
        })
        .collect()
}

/// Applies a change to the running config; with `server.save_on_change`, saves it after.
/// Targets and LUNs it makes are remembered as unsaved until a save or reload.
fn change(registry: &Registry, req: AdminRequest) -> Result<Value, String> {
    let made = match &req {
        AdminRequest::LunAdd { target, lun } => Some(format!("{target} LUN {}", lun.lun)),
        AdminRequest::TargetAdd { target } => Some(format!("target {}", target.name)),
        AdminRequest::SubsystemAdd { subsystem } => Some(format!("subsystem {}", subsystem.nqn)),
        AdminRequest::NamespaceAdd {
            subsystem,
            namespace,
        } => Some(format!(
            "subsystem {subsystem} namespace {}",
            namespace.nsid
        )),
        _ => None,
    };
    let gone = match &req {
        AdminRequest::LunRemove { target, lun, .. } => Some(format!("{target} LUN {lun}")),
        AdminRequest::TargetRemove { name, .. } => Some(format!("target {name}")),
        AdminRequest::SubsystemRemove { nqn, .. } => Some(format!("subsystem {nqn}")),
        AdminRequest::NamespaceRemove {
            subsystem, nsid, ..
        } => Some(format!("subsystem {subsystem} namespace {nsid}")),
        _ => None,
    };
    // What the administrator allowed to be destroyed or broken.
    let force = matches!(
        req,
        AdminRequest::LunResize { force: true, .. }
            | AdminRequest::LunRemove { force: true, .. }
            | AdminRequest::TargetRemove { force: true, .. }
            | AdminRequest::NamespaceRemove { force: true, .. }
            | AdminRequest::NamespaceResize { force: true, .. }
            | AdminRequest::SubsystemRemove { force: true, .. }
    );
    // A portal may be named by the address it bound (after port 0).
    let req = match req {
        AdminRequest::PortalRemove { address } => AdminRequest::PortalRemove {
            address: registry.portal_text(&address).unwrap_or(address),
        },
        other => other,
    };
    let mut config = registry.config().clone();
    edit(&mut config, req)?;
    let changes = registry.apply(config, force)?;
    {
        let mut unsaved = crate::lock(&registry.unsaved);
        if let Some(what) = made {
            unsaved.insert(what);
        }
        if let Some(what) = gone {
            // What was made inside it goes with it.
            let inside = match what.strip_prefix("target ") {
                Some(name) => Some(format!("{name} LUN ")),
                None => what
                    .strip_prefix("subsystem ")
                    .filter(|nqn| !nqn.contains(" namespace "))
                    .map(|nqn| format!("subsystem {nqn} namespace ")),
            };
            unsaved.retain(|u| *u != what && inside.as_ref().is_none_or(|p| !u.starts_with(p)));
        }
    }
    let mut changes = changes;
    if registry.config().server.save_on_change {
        let notes = save(registry, &registry.config_path)
            .map_err(|e| format!("applied ({}), but not saved: {e}", changes.join("; ")))?;
        changes.extend(notes);
    }
    Ok(json!(changes))
}

/// Writes the running config to `path`, and returns what the administrator should know.
///
/// An existing file keeps its comments, layout and unchanged values
/// ([`crate::config_file::merge`]), and its previous contents go to `PATH.bak` first. A save
/// over the daemon's own file that finds it changed since targetd last read or wrote it says
/// so (the edits are in the backup) and logs a warning. Both files are written atomically: a
/// temporary file beside them (mode 0600: they hold CHAP secrets), synced, renamed, and the
/// directory synced, so a crash leaves the old file or the new one, never a torn one.
pub fn save(registry: &Registry, path: &Path) -> Result<Vec<String>, String> {
    let config = registry.config().clone();
    let shown = |e: std::io::Error| format!("{}: {e}", path.display());
    let old = match std::fs::read_to_string(path) {
        Ok(text) => Some(text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(shown(e)),
    };
    let mut notes = Vec::new();
    let whole = || -> Result<String, String> {
        let text = toml::to_string(&config).map_err(|e| e.to_string())?;
        Ok(format!(
            "# Saved by targetd from its running configuration (targetctl config save).\n{text}"
        ))
    };
    let text = match &old {
        None => whole()?,
        Some(old) => match crate::config_file::merge(old, path.parent(), &config) {
            Ok(text) => text,
            Err(e) => {
                notes.push(format!("{}: {e}; written whole", path.display()));
                whole()?
            }
        },
    };
    if let Some(old) = &old {
        let backup = backup_path(path);
        scsi_core::pr::replace_file(&backup, old.as_bytes(), 0o600)
            .map_err(|e| format!("{}: {e}", backup.display()))?;
        let own = path == registry.config_path;
        if own && crate::registry::file_fingerprint(path) != *lock(&registry.config_seen) {
            let note = format!(
                "{} had changed on disk since targetd last read or wrote it: those edits are \
                 overwritten by the running config and kept in {}",
                path.display(),
                backup.display()
            );
            tracing::warn!("{note}");
            notes.push(note);
        }
    }
    scsi_core::pr::replace_file(path, text.as_bytes(), 0o600).map_err(shown)?;
    // The daemon's own file now holds everything that runs.
    if path == registry.config_path {
        lock(&registry.unsaved).clear();
        *lock(&registry.config_seen) = crate::registry::file_fingerprint(path);
    }
    Ok(notes)
}

/// Where a save keeps the file it replaces: `PATH.bak`.
pub fn backup_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".bak");
    PathBuf::from(name)
}

/// Makes a change to a copy of the config.
fn edit(config: &mut Config, change: AdminRequest) -> Result<(), String> {
    let target = |config: &mut Config, name: &str| -> Result<usize, String> {
        config
            .targets
            .iter()
            .position(|t| t.name.eq_ignore_ascii_case(name))
            .ok_or(format!("no target {name}"))
    };
    let subsystem = |config: &mut Config, nqn: &str| -> Result<usize, String> {
        config
            .subsystems
            .iter()
            .position(|s| s.nqn == nqn)
            .ok_or(format!("no subsystem {nqn}"))
    };
    match change {
        AdminRequest::SubsystemAdd { subsystem } => {
            if config.subsystems.iter().any(|s| s.nqn == subsystem.nqn) {
                return Err(format!("subsystem {} exists already", subsystem.nqn));
            }
            config.subsystems.push(subsystem);
        }
        AdminRequest::SubsystemRemove { nqn, .. } => {
            let i = subsystem(config, &nqn)?;
            config.subsystems.remove(i);
        }
        AdminRequest::NamespaceAdd {
            subsystem: nqn,
            namespace,
        } => {
            let i = subsystem(config, &nqn)?;
            if config.subsystems[i]
                .namespaces
                .iter()
                .any(|n| n.nsid == namespace.nsid)
            {
                return Err(format!("{nqn} has a namespace {} already", namespace.nsid));
            }
            config.subsystems[i].namespaces.push(namespace);
        }
        AdminRequest::NamespaceRemove {
            subsystem: nqn,
            nsid,
            ..
        } => {
            let i = subsystem(config, &nqn)?;
            let before = config.subsystems[i].namespaces.len();
            config.subsystems[i].namespaces.retain(|n| n.nsid != nsid);
            if config.subsystems[i].namespaces.len() == before {
                return Err(format!("{nqn} has no namespace {nsid}"));
            }
        }
        AdminRequest::NamespaceResize {
            subsystem: nqn,
            nsid,
            size,
            ..
        } => {
            let i = subsystem(config, &nqn)?;
            let bytes = config::parse_size(&size)?;
            let n = config.subsystems[i]
                .namespaces
                .iter_mut()
                .find(|n| n.nsid == nsid)
                .ok_or(format!("{nqn} has no namespace {nsid}"))?;
            n.unit.size = Some(config::Size(bytes));
        }
        AdminRequest::LunAdd { target: t, lun } => {
            let i = target(config, &t)?;
            if config.targets[i].luns.iter().any(|l| l.lun == lun.lun) {
                return Err(format!("{t} has a LUN {} already", lun.lun));
            }
            config.targets[i].luns.push(lun);
        }
        AdminRequest::LunRemove { target: t, lun, .. } => {
            let i = target(config, &t)?;
            let before = config.targets[i].luns.len();
            config.targets[i].luns.retain(|l| l.lun != lun);
            if config.targets[i].luns.len() == before {
                return Err(format!("{t} has no LUN {lun}"));
            }
        }
        AdminRequest::LunResize {
            target: t,
            lun,
            size,
            ..
        } => {
            let i = target(config, &t)?;
            let bytes = config::parse_size(&size)?;
            let l = config.targets[i]
                .luns
                .iter_mut()
                .find(|l| l.lun == lun)
                .ok_or(format!("{t} has no LUN {lun}"))?;
            l.size = Some(config::Size(bytes));
        }
        AdminRequest::TargetAdd { target: t } => {
            if target(config, &t.name).is_ok() {
                return Err(format!("target {} exists", t.name));
            }
            config.targets.push(t);
        }
        AdminRequest::TargetRemove { name, .. } => {
            let i = target(config, &name)?;
            config.targets.remove(i);
        }
        AdminRequest::PortalAdd { address } => {
            // Port 0 asks for one more portal on a free port, however often.
            let any_port = address
                .parse::<std::net::SocketAddr>()
                .is_ok_and(|a| a.port() == 0);
            if !any_port && config.server.portals.contains(&address) {
                return Err(format!("{address} is a portal already"));
            }
            config.server.portals.push(address);
        }
        AdminRequest::PortalRemove { address } => {
            let i = config
                .server
                .portals
                .iter()
                .position(|p| *p == address)
                .ok_or(format!("{address} is no portal"))?;
            if config.server.portals.len() == 1 {
                return Err(format!("{address} is the only portal: add another first"));
            }
            config.server.portals.remove(i);
        }
        AdminRequest::TargetSet {
            name,
            initiators,
            networks,
            srp_initiators,
            chap,
            mutual_chap,
            no_chap,
            no_mutual_chap,
        } => {
            let i = target(config, &name)?;
            let t = &mut config.targets[i];
            if let Some(v) = initiators {
                t.initiators = v;
            }
            if let Some(v) = networks {
                t.networks = v;
            }
            if let Some(v) = srp_initiators {
                t.srp_initiators = v;
            }
            if chap.is_some() || no_chap {
                t.chap = chap;
            }
            if mutual_chap.is_some() || no_chap || no_mutual_chap {
                t.mutual_chap = mutual_chap;
            }
        }
        other => return Err(format!("{other:?} is not a change")),
    }
    Ok(())
}

fn status(registry: &Registry) -> Value {
    let c = registry.config();
    json!({
        "version": env!("CARGO_PKG_VERSION"),
        "pid": std::process::id(),
        "uptime_seconds": registry.started.elapsed().as_secs(),
        "portals": registry.portals.lock().map(|p| p.iter().map(|a| a.to_string()).collect::<Vec<_>>()).unwrap_or_default(),
        "engine": registry.engine.lock().map(|e| e.clone()).unwrap_or_default(),
        "targets": registry.targets().len(),
        "sessions": registry.sessions.all().len(),
        "connections": registry.connection_count(),
        "iser_portals": c.server.iser_portals,
        "nvme_rdma_portals": c.server.nvme_rdma_portals,
        "nvme_portals": registry.nvme_portals.lock().map(|p| p.0.iter().map(|a| a.to_string()).collect::<Vec<_>>()).unwrap_or_default(),
        "nvme_discovery_portals": registry.nvme_portals.lock().map(|p| p.1.iter().map(|a| a.to_string()).collect::<Vec<_>>()).unwrap_or_default(),
        "subsystems": registry.subsystems().len(),
        "nvme_controllers": registry.subsystems().iter().map(|s| s.controllers().len()).sum::<usize>(),
        "srp_portals": c.server.rdma_portals,
        "cluster_gateway": c.cluster.as_ref().map(|k| k.gateway.clone()),
        "config": registry.config_path.display().to_string(),
        "admin_socket": c.server.admin_socket.display().to_string(),
    })
}

/// Each NVM subsystem: NQN, hosts, namespaces (NSID, backend, path or image, size, block
/// size) and the controllers connected (CNTLID, host NQN, the I/O queues it connected).
fn subsystems(registry: &Registry) -> Value {
    Value::Array(
        registry
            .subsystems()
            .iter()
            .map(|s| {
                let hosts = s.config.read().map(|c| c.hosts.clone()).unwrap_or_default();
                let namespaces: Vec<Value> = s
                    .namespaces()
                    .into_iter()
                    .map(|(nsid, unit)| {
                        json!({
                            "nsid": nsid,
                            "backend": unit.config.backend,
                            "path": unit.config.path.as_ref().map(|p| p.display().to_string()),
                            "image": unit.config.image,
                            "bytes": unit.blocks * u64::from(unit.block_size),
                            "block_size": unit.block_size,
                        })
                    })
                    .collect();
                let controllers: Vec<Value> = s
                    .controllers_and_queues()
                    .into_iter()
                    .map(|(id, host, io_queues)| {
                        json!({ "cntlid": id, "host": host, "io_queues": io_queues })
                    })
                    .collect();
                json!({
                    "nqn": s.nqn,
                    "hosts": hosts,
                    "namespaces": namespaces,
                    "controllers": controllers,
                })
            })
            .collect(),
    )
}

fn targets(registry: &Registry) -> Value {
    let sessions = registry.sessions.all();
    Value::Array(
        registry
            .targets()
            .iter()
            .map(|t| {
                let luns: Vec<u16> = t.lun_list().iter().map(|l| l.config.lun).collect();
                json!({
                    "name": t.name,
                    "luns": luns,
                    "sessions": sessions.iter().filter(|s| Arc::ptr_eq(&s.target, t)).count(),
                    "srp_port_id": crate::srp::hex(&crate::srp::port_id(&t.name)),
                    "core_lock_acquisitions": t.core_acquisitions(),
                })
            })
            .collect(),
    )
}

fn luns(registry: &Registry, target: Option<&str>) -> Result<Value, String> {
    let mut out = Vec::new();
    let targets = registry.targets();
    if let Some(name) = target {
        if !targets.iter().any(|t| t.name.eq_ignore_ascii_case(name)) {
            return Err(format!("no target {name}"));
        }
    }
    for t in targets
        .iter()
        .filter(|t| target.is_none_or(|n| t.name.eq_ignore_ascii_case(n)))
    {
        for lun in t.lun_list() {
            let c = &lun.config;
            out.push(json!({
                "target": t.name,
                "lun": c.lun,
                "backend": c.backend,
                "path": c.path.as_ref().map(|p| p.display().to_string()),
                "size": lun.blocks * u64::from(lun.block_size),
                "block_size": lun.block_size,
                "thin": c.thin,
                "write_cache": c.write_cache,
                "read_only": c.read_only,
                "faults": lun.faults.armed(),
                "rbd": lun.storage.details(),
            }));
        }
    }
    Ok(Value::Array(out))
}

/// The cluster view, or `forget` a gateway; refused where this targetd is not in a cluster.
fn cluster(registry: &Registry, forget: Option<&str>) -> Result<Value, String> {
    if let Some(cluster) = &registry.target_env.cluster {
        return match forget {
            Some(gateway) => cluster.forget(gateway).map(|said| json!(said)),
            None => Ok(cluster.view()),
        };
    }
    Err(if cfg!(feature = "rbd") {
        "this targetd is not in a cluster (no [cluster] in its config)".into()
    } else {
        "this targetd is not in a cluster (built without the feature rbd, which clusters need)"
            .into()
    })
}

/// Every session: iSCSI sessions with their connections, then SRP I_T nexuses with their
/// channels (`transport` tells which).
pub fn sessions_json(registry: &Registry) -> Value {
    let mut all: Vec<Value> = registry
        .sessions
        .all()
        .iter()
        .map(|s| {
            let o = &s.params.operational;
            let conns: Vec<Value> = registry
                .sessions
                .connections(s)
                .iter()
                .map(|c| {
                    json!({
                        "cid": c.cid,
                        "transport": if c.iser { "iser" } else { "tcp" },
                        "peer": c.peer.to_string(),
                        "portal": c.local.to_string(),
                        "reactor": c.reactor,
                        "header_digest": if c.digests.0 { "CRC32C" } else { "None" },
                        "data_digest": if c.digests.1 { "CRC32C" } else { "None" },
                        "max_recv_data_segment_length": c.segment_lengths.0,
                        "initiator_max_recv_data_segment_length": c.segment_lengths.1,
                    })
                })
                .collect();
            let (exp, max) = s.window();
            json!({
                "transport": "iscsi",
                "tsih": s.tsih,
                "target": s.target.name,
                "initiator": s.initiator,
                "isid": s.isid.to_string(),
                "exp_cmd_sn": exp.0,
                "max_cmd_sn": max.0,
                "keys": {
                    "MaxConnections": o.max_connections,
                    "InitialR2T": o.initial_r2t,
                    "ImmediateData": o.immediate_data,
                    "MaxBurstLength": o.max_burst_length,
                    "FirstBurstLength": o.first_burst_length,
                    "MaxOutstandingR2T": o.max_outstanding_r2t,
                    "DataPDUInOrder": o.data_pdu_in_order,
                    "DataSequenceInOrder": o.data_sequence_in_order,
                    "ErrorRecoveryLevel": o.error_recovery_level,
                    "DefaultTime2Wait": o.default_time2wait,
                    "DefaultTime2Retain": o.default_time2retain,
                    "AuthMethod": s.params.auth_method.map(|m| m.as_str()),
                },
                "connections": conns,
            })
        })
        .collect();
    // SRP channels grouped by their I_T nexus.
    let channels = registry.srp_channels();
    let mut nexuses: Vec<(String, scsi_core::NexusId, Vec<Value>)> = Vec::new();
    for c in channels.values() {
        let channel = json!({
            "portal": c.portal,
            "reactor": c.reactor,
            "request_limit": c.request_limit,
            "max_it_iu_len": c.iu_lengths.0,
            "max_ti_iu_len": c.iu_lengths.1,
        });
        match nexuses
            .iter_mut()
            .find(|(t, n, _)| *t == c.target && *n == c.nexus)
        {
            Some((_, _, list)) => list.push(channel),
            None => nexuses.push((c.target.clone(), c.nexus, vec![channel])),
        }
    }
    for (target, nexus, list) in nexuses {
        let first = channels
            .values()
            .find(|c| c.target == target && c.nexus == nexus)
            .expect("grouped from these");
        all.push(json!({
            "transport": "srp",
            "target": target,
            "initiator": crate::srp::hex(&first.initiator_port_id),
            "target_port_id": crate::srp::hex(&first.target_port_id),
            "channels": list,
        }));
    }
    Value::Array(all)
}

fn stats(registry: &Registry) -> Value {
    let mut out = Vec::new();
    for t in registry.targets() {
        for lun in t.lun_list() {
            let s = &lun.stats;
            out.push(json!({
                "target": t.name,
                "lun": lun.config.lun,
                "read_commands": s.read_commands.load(Relaxed),
                "write_commands": s.write_commands.load(Relaxed),
                "other_commands": s.other_commands.load(Relaxed),
                "read_bytes": s.read_bytes.load(Relaxed),
                "write_bytes": s.write_bytes.load(Relaxed),
                "read_latency_ns": s.read_latency_ns.load(Relaxed),
                "write_latency_ns": s.write_latency_ns.load(Relaxed),
                "errors": s.errors.load(Relaxed),
            }));
        }
    }
    Value::Array(out)
}
