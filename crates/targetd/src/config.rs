//! The daemon's configuration (every key commented in the repository's config.toml): parsed with serde, then checked as a
//! whole, so a bad file is refused at start with the key and the reason.
//!
//! Unknown keys are refused (`deny_unknown_fields`); TOML syntax and type errors carry the
//! line and column; every other check names the key as a path, e.g.
//! `targets[0].luns[1].size: 1000 is not a multiple of block_size 512`.

use std::collections::{BTreeMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use iscsi_pdu::negotiation::{DigestAlgorithm, Settings};
use serde::{Deserialize, Serialize};

/// A refused configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// Not TOML, a wrong type or an unknown key (the message has line and column).
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A value that parses but is refused.
    #[error("{path}: {key}: {reason}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The key, as a path from the top of the file.
        key: String,
        /// Why.
        reason: String,
    },
}

/// The whole file.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Listeners, admin socket, reactors.
    pub server: Server,
    /// What the target offers in login negotiation.
    #[serde(default)]
    pub iscsi: Iscsi,
    /// The targets exported.
    #[serde(default)]
    pub targets: Vec<Target>,
    /// What NVMe/TCP controllers offer every host.
    #[serde(default)]
    #[serde(skip_serializing_if = "Nvme::is_default")]
    pub nvme: Nvme,
    /// The NVM subsystems exported over NVMe/TCP (`server.nvme_portals`).
    #[serde(default)]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub subsystems: Vec<Subsystem>,
    /// This gateway's place among several that export the same targets and RBD images
    /// (feature `rbd`): reservations kept in RADOS, one target port group per gateway.
    #[serde(default)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster: Option<Cluster>,
}

/// `[cluster]`: several targetd gateways export the same targets and RBD images as one.
/// Every gateway's file lists the same targets and LUNs; each has its own `gateway` and
/// `port_group`. The RBD units' reservations (persistent and SPC-2) are one RADOS object per
/// image in `pool`, changed by compare-and-swap; a change is acknowledged to the initiator
/// once every gateway watching it has applied it.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    /// The cluster's name: the prefix of its objects in `pool`.
    pub name: String,
    /// This gateway's name, unique in the cluster.
    pub gateway: String,
    /// This gateway's target portal group tag, which is also its relative target port
    /// identifier: unique among the cluster's gateways, 1 to 65535.
    pub port_group: u16,
    /// The pool of the shared objects.
    pub pool: String,
    /// Their RADOS namespace.
    #[serde(default)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The cluster's ceph.conf; librados' default search when absent.
    #[serde(default)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ceph_conf: Option<PathBuf>,
    /// The cephx id, without "client." ("admin" when absent).
    #[serde(default)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client: Option<String>,
    /// The keyring with the client's key; the ceph.conf's keyring when absent.
    #[serde(default)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keyring: Option<PathBuf>,
    /// Seconds a monitor or OSD may take to answer.
    #[serde(default, deserialize_with = "units::serde::optional_seconds")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ceph_timeout: Option<u64>,
    /// Seconds every other gateway gets to apply a change to the reservations before the
    /// command that made it ends without them (and the silent gateways are logged).
    #[serde(
        default = "default_notify_timeout",
        deserialize_with = "units::serde::seconds"
    )]
    pub notify_timeout: u64,
    /// How often each gateway asks which gateways are alive.
    #[serde(
        default = "default_membership_interval",
        deserialize_with = "units::serde::duration",
        serialize_with = "units::serde::write_duration"
    )]
    pub membership_interval: Duration,
    /// How long a gateway has to answer "who is alive" before the others fence it.
    #[serde(
        default = "default_membership_timeout",
        deserialize_with = "units::serde::duration",
        serialize_with = "units::serde::write_duration"
    )]
    pub membership_timeout: Duration,
}

fn default_notify_timeout() -> u64 {
    5
}

/// Every half second: with [`default_membership_timeout`], a gateway that dies is fenced
/// within 1.5 s of its death.
fn default_membership_interval() -> Duration {
    Duration::from_millis(500)
}

/// A second: a gateway that is busy but alive answers in milliseconds (its answer is sent
/// from librados' own thread), so only one that is gone or cut off misses it.
fn default_membership_timeout() -> Duration {
    Duration::from_secs(1)
}

/// `[server]`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Server {
    /// iSCSI/TCP listen addresses, `host:port`.
    pub portals: Vec<String>,
    /// Unix socket for targetctl (created mode 0600).
    #[serde(default = "default_admin_socket")]
    pub admin_socket: PathBuf,
    /// Reactor threads; 0 = one per CPU core.
    #[serde(default)]
    pub reactors: usize,
    /// How long a reactor keeps polling its sockets and rings after its connections last did
    /// something, instead of sleeping: a request that comes meanwhile is found without the
    /// thread being woken, for latency-bound initiators, at the cost of a core per busy
    /// reactor. 0 (the default): a reactor sleeps as soon as nothing is ready.
    #[serde(
        default,
        deserialize_with = "units::serde::duration",
        serialize_with = "units::serde::write_duration"
    )]
    pub busy_poll: Duration,
    /// Prometheus text endpoint, off when absent.
    #[serde(default)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<String>,
    /// SRP over RDMA listen addresses (feature `rdma`).
    #[serde(default)]
    pub rdma_portals: Vec<String>,
    /// iSER (iSCSI over RDMA) listen addresses (feature `rdma`).
    #[serde(default)]
    pub iser_portals: Vec<String>,
    /// NVMe/RDMA listen addresses, `address:port` (feature `rdma`; 4420 is NVMe/RDMA's
    /// port): the subsystems of `[[subsystems]]` over RDMA.
    #[serde(default)]
    pub nvme_rdma_portals: Vec<String>,
    /// NVMe/TCP listen addresses, `host:port` (4420 is NVMe/TCP's port); the subsystems
    /// of `[[subsystems]]` are reached through each.
    #[serde(default)]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub nvme_portals: Vec<String>,
    /// NVMe/TCP discovery controllers' listen addresses (8009 is discovery's port): hosts
    /// ask there which subsystems they may reach (`nvme discover`). Every NVMe/TCP portal
    /// answers discovery too.
    #[serde(default)]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub nvme_discovery_portals: Vec<String>,
    /// The I/O engine: "auto", "uring" or "threads".
    #[serde(default = "default_engine")]
    pub engine: String,
    /// tracing filter (RUST_LOG syntax); RUST_LOG overrides it.
    #[serde(default)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log: Option<String>,
    /// Seconds between target NOP-In pings on an idle connection; 0 = off.
    #[serde(
        default = "default_nop_interval",
        deserialize_with = "units::serde::seconds"
    )]
    pub nop_interval: u64,
    /// Seconds without an answer before the connection is dropped.
    #[serde(
        default = "default_nop_timeout",
        deserialize_with = "units::serde::seconds"
    )]
    pub nop_timeout: u64,
    /// Seconds a connection may take to finish its login; it is closed after that.
    #[serde(
        default = "default_login_timeout",
        deserialize_with = "units::serde::seconds"
    )]
    pub login_timeout: u64,
    /// Seconds a connection may have data to send and no room in its socket (the initiator
    /// stopped reading) before it is dropped, giving back the buffers it holds.
    #[serde(
        default = "default_send_timeout",
        deserialize_with = "units::serde::seconds"
    )]
    pub send_timeout: u64,
    /// Seconds a connection may owe data-out (an R2T, unsolicited data, or the command an
    /// earlier CmdSN names) and send none before it is dropped, giving back the write buffers
    /// it holds.
    #[serde(
        default = "default_data_out_timeout",
        deserialize_with = "units::serde::seconds"
    )]
    pub data_out_timeout: u64,
    /// Connections the daemon keeps open at once, logged in or not; more are closed as soon
    /// as they are accepted.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Normal sessions the daemon keeps at once; a login that would make one more is refused
    /// with "out of resources".
    #[serde(default = "default_max_sessions")]
    pub max_sessions: usize,
    /// Where state that must outlive the daemon is kept: persistent reservations made with
    /// APTPL, one file per logical unit, written atomically and synced before the command
    /// ends. Without it, PERSISTENT RESERVE OUT with APTPL is refused (ILLEGAL REQUEST).
    #[serde(default)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state_dir: Option<PathBuf>,
    /// Save the running config to the file targetd was started with after every successful
    /// live change (as `targetctl config save` does), so changes made with targetctl outlive
    /// a restart.
    #[serde(default)]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub save_on_change: bool,
    /// On SIGTERM from a service manager with a file descriptor store (systemd's
    /// `FileDescriptorStoreMax=`), park the iSCSI/TCP sessions and NVMe/TCP controllers and
    /// put their connections,
    /// the listening sockets and the sessions' state in the store instead of asking the
    /// initiators to log out, so that the next start (`systemctl restart`) serves them on
    /// where they stopped. A stop that is not followed by a start then closes those
    /// connections without a logout (the initiators reconnect once targetd is back).
    #[serde(default)]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub restart_keeps_sessions: bool,
    /// SRP ports (RDMA portals and the software fabric): the largest IU an initiator may
    /// send, bytes, from 80 to 9288 (the ports' receive buffers); 8276 by default, as Linux's
    /// ib_srpt: ib_srp's default login with 8 KiB of immediate data asks for 8260.
    #[serde(default = "default_srp_max_iu_len")]
    pub srp_max_iu_len: u32,
    /// SRP ports: requests an initiator may have outstanding on a channel (its credit), 1 to
    /// 1024; the receives each channel keeps posted.
    #[serde(default = "default_srp_request_limit")]
    pub srp_request_limit: u32,
    /// SRP ports: grant immediate data (SRP-2) to initiators that ask, so that a write that
    /// fits in the IU needs no RDMA READ.
    #[serde(default = "default_true")]
    pub srp_immediate_data: bool,
    /// One RDMA portal's own SRP terms, by its address as `rdma_portals` names it
    /// (`[server.srp_ports."192.0.2.10:5555"]`); a key not given there is the server's
    /// `srp_*` key.
    #[serde(default)]
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub srp_ports: BTreeMap<String, SrpPortTerms>,
}

/// An SRP port's own terms (`server.srp_ports`): each absent key is the server's.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SrpPortTerms {
    /// The largest IU an initiator may send (`srp_max_iu_len`): with immediate data, the
    /// largest write that comes in the SRP_CMD is this less its offset (68 for Linux).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_iu_len: Option<u32>,
    /// Requests outstanding per channel (`srp_request_limit`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_limit: Option<u32>,
    /// Grant immediate data (`srp_immediate_data`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub immediate_data: Option<bool>,
}

/// What an SRP port offers at login, resolved from its `srp_ports` table and the server's keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SrpTerms {
    /// The largest SRP_CMD it accepts, in bytes.
    pub max_iu_len: u32,
    /// Requests outstanding per channel.
    pub request_limit: u32,
    /// Whether it grants immediate data.
    pub immediate_data: bool,
}

impl Server {
    /// The SRP terms of the RDMA portal at `address` (its `srp_ports` table over the
    /// server's keys), or the server's for a port without one (the software fabric's).
    pub fn srp_terms(&self, address: Option<SocketAddr>) -> SrpTerms {
        let own = address.and_then(|a| {
            self.srp_ports
                .iter()
                .find(|(k, _)| k.parse::<SocketAddr>().ok() == Some(a))
                .map(|(_, t)| t)
        });
        let own = own.cloned().unwrap_or_default();
        SrpTerms {
            max_iu_len: own.max_iu_len.unwrap_or(self.srp_max_iu_len),
            request_limit: own.request_limit.unwrap_or(self.srp_request_limit),
            immediate_data: own.immediate_data.unwrap_or(self.srp_immediate_data),
        }
    }
}

fn default_srp_max_iu_len() -> u32 {
    srp::target_port::DEFAULT_MAX_IT_IU_LEN
}
fn default_srp_request_limit() -> u32 {
    srp::target_port::PortSettings::default().request_limit
}
fn default_true() -> bool {
    true
}

fn default_admin_socket() -> PathBuf {
    "targetd.sock".into()
}
fn default_engine() -> String {
    "auto".into()
}
fn default_nop_interval() -> u64 {
    30
}
fn default_nop_timeout() -> u64 {
    15
}
fn default_login_timeout() -> u64 {
    30
}
/// The longest `server.busy_poll`.
pub const MAX_BUSY_POLL: Duration = Duration::from_secs(1);

fn default_send_timeout() -> u64 {
    30
}
fn default_data_out_timeout() -> u64 {
    30
}
fn default_max_connections() -> usize {
    1024
}
fn default_max_sessions() -> usize {
    1024
}

/// `[iscsi]`: the values the target offers.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Iscsi {
    /// MaxRecvDataSegmentLength the target declares.
    pub max_recv_data_segment_length: u32,
    /// MaxBurstLength offered.
    pub max_burst_length: u32,
    /// FirstBurstLength offered.
    pub first_burst_length: u32,
    /// ImmediateData offered.
    pub immediate_data: bool,
    /// InitialR2T offered.
    pub initial_r2t: bool,
    /// MaxOutstandingR2T offered.
    pub max_outstanding_r2t: u16,
    /// MaxConnections offered.
    pub max_connections: u16,
    /// Commands the initiator may have outstanding (MaxCmdSN - ExpCmdSN + 1). The default,
    /// 2048, is the deepest queue open-iscsi lets a session have (`node.session.cmds_max`
    /// at most 2048), so the target is never what caps an initiator's concurrency (paper 000
    /// found a target window of 128 capping reads over a 16 ms link at 128 per round trip).
    /// What it costs is bounded: a command outside the window is dropped, each admitted one
    /// holds fixed-size task state (a few hundred bytes), and its data buffers come out of
    /// its connection's share of the arena (writes beyond it are answered TASK SET FULL).
    pub cmdsn_window: u32,
    /// HeaderDigest values, in preference order.
    pub header_digest: Vec<String>,
    /// DataDigest values, in preference order.
    pub data_digest: Vec<String>,
    /// CHAP an initiator must pass to open a discovery session; open when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub discovery_chap: Option<Chap>,
    /// The target's own CHAP credentials for mutual CHAP in discovery sessions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub discovery_mutual_chap: Option<Chap>,
}

/// The default `iscsi.cmdsn_window` (see [`Iscsi::cmdsn_window`]).
pub const DEFAULT_CMDSN_WINDOW: u32 = 2048;

impl Default for Iscsi {
    fn default() -> Self {
        Iscsi {
            max_recv_data_segment_length: 262_144,
            max_burst_length: 1_048_576,
            first_burst_length: 262_144,
            immediate_data: true,
            initial_r2t: false,
            max_outstanding_r2t: 16,
            max_connections: 8,
            cmdsn_window: DEFAULT_CMDSN_WINDOW,
            header_digest: vec!["None".into(), "CRC32C".into()],
            data_digest: vec!["None".into(), "CRC32C".into()],
            discovery_chap: None,
            discovery_mutual_chap: None,
        }
    }
}

/// `[[targets]]`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Target {
    /// The target's iSCSI name.
    pub name: String,
    /// Initiator names allowed; empty = any.
    #[serde(default)]
    pub initiators: Vec<String>,
    /// Source networks allowed (CIDR); empty = any.
    #[serde(default)]
    pub networks: Vec<String>,
    /// SRP initiator port identifiers allowed (32 hex digits). Empty: any SRP initiator
    /// when `initiators` is empty too, none when `initiators` restricts iSCSI (a target
    /// closed to some initiators does not open to every SRP one).
    #[serde(default)]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub srp_initiators: Vec<String>,
    /// CHAP the initiator must pass.
    #[serde(default)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chap: Option<Chap>,
    /// CHAP the target answers (mutual); needs `chap`.
    #[serde(default)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mutual_chap: Option<Chap>,
    /// Logical units.
    #[serde(default)]
    pub luns: Vec<Lun>,
}

/// CHAP credentials. Their `Debug` never shows the secret, and [`Config::redacted`] (what
/// `targetctl config dump` prints) replaces it.
#[derive(Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Chap {
    /// CHAP_N.
    pub username: String,
    /// The shared secret.
    pub secret: String,
}

/// What a secret is shown as.
pub const REDACTED: &str = "<redacted>";

impl std::fmt::Debug for Chap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chap")
            .field("username", &self.username)
            .field("secret", &REDACTED)
            .finish()
    }
}

/// `[nvme]`: what the NVMe/TCP controllers offer every host.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct Nvme {
    /// Data an I/O command may carry in its capsule, bytes (the I/O queue command capsule
    /// less its SQE; a multiple of 16, at most 131072): a write this size or smaller needs
    /// no R2T. Linux's host sends writes up to it in the capsule.
    pub in_capsule_data_size: u32,
    /// Grant header digests (CRC32C) to a host that asks.
    pub header_digest: bool,
    /// Grant data digests (CRC32C) to a host that asks.
    pub data_digest: bool,
    /// I/O queues a controller may have, 1 to 128 (Linux's host asks one per CPU).
    pub max_io_queues: u16,
    /// Entries an I/O queue may have, 32 to 1024 (MQES + 1): commands a host may have
    /// outstanding on one queue.
    pub queue_entries: u16,
    /// The most data one H2CData PDU may carry (MAXH2CDATA), bytes: 4096 to 1048576, a
    /// multiple of 4.
    pub max_h2c_data: u32,
}

impl Default for Nvme {
    fn default() -> Self {
        Nvme {
            in_capsule_data_size: 8192,
            header_digest: true,
            data_digest: true,
            max_io_queues: 8,
            queue_entries: 128,
            max_h2c_data: 128 * 1024,
        }
    }
}

impl Nvme {
    fn is_default(&self) -> bool {
        *self == Nvme::default()
    }
}

/// `[[subsystems]]`: an NVM subsystem, its hosts and its namespaces.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Subsystem {
    /// The subsystem's NQN (`nqn.yyyy-mm.reverse.domain:name`).
    pub nqn: String,
    /// The serial number its controllers report (up to 20 ASCII characters); by default
    /// one derived from the NQN, the same at every start.
    #[serde(default)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    /// The model its controllers report (up to 40 ASCII characters); "targetd" by default.
    #[serde(default)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Host NQNs allowed to connect; empty = any host.
    #[serde(default)]
    pub hosts: Vec<String>,
    /// Namespaces.
    #[serde(default)]
    pub namespaces: Vec<Namespace>,
}

/// The largest NSID a namespace may have here.
pub const MAX_NSID: u32 = 1024;

/// `[[subsystems.namespaces]]`: `nsid` and where its blocks are, in the keys a LUN has
/// (`backend`, `path`, `size`, `block_size`, `pool`, `image`, ...); `lun` is not one.
#[derive(Debug, Clone)]
pub struct Namespace {
    /// NSID, 1 to [`MAX_NSID`].
    pub nsid: u32,
    /// Its storage, as a LUN's (whose `lun` is the NSID's low bits, unused).
    pub unit: Lun,
}

/// Two namespaces are the same when their NSIDs and storage keys are: the unit's `lun`, which
/// no file sets, is not compared.
impl PartialEq for Namespace {
    fn eq(&self, other: &Namespace) -> bool {
        self.nsid == other.nsid
            && Lun {
                lun: 0,
                ..self.unit.clone()
            } == Lun {
                lun: 0,
                ..other.unit.clone()
            }
    }
}

impl<'de> Deserialize<'de> for Namespace {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Namespace, D::Error> {
        use serde::de::Error;
        let mut table = toml::Table::deserialize(d)?;
        if table.contains_key("lun") {
            return Err(D::Error::custom(
                "unknown field `lun`: a namespace is numbered by `nsid`",
            ));
        }
        let nsid = table
            .remove("nsid")
            .ok_or_else(|| D::Error::missing_field("nsid"))?;
        let nsid = nsid
            .as_integer()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| D::Error::custom(format!("nsid: {nsid} is not a namespace ID")))?;
        table.insert("lun".into(), toml::Value::Integer(i64::from(nsid & 0x3fff)));
        let unit = Lun::deserialize(toml::Value::Table(table)).map_err(D::Error::custom)?;
        Ok(Namespace { nsid, unit })
    }
}

impl Serialize for Namespace {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{Error, SerializeMap};
        let unit = toml::Value::try_from(&self.unit).map_err(S::Error::custom)?;
        let toml::Value::Table(mut table) = unit else {
            return Err(S::Error::custom("a unit is a table"));
        };
        table.remove("lun");
        let mut map = s.serialize_map(Some(table.len() + 1))?;
        map.serialize_entry("nsid", &self.nsid)?;
        for (k, v) in &table {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

/// `[[targets.luns]]`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Lun {
    /// LUN number, 0..=16383.
    pub lun: u16,
    /// "file", "memory", "null" or "rbd" (a Ceph RBD image; targetd built with the feature
    /// `rbd`).
    pub backend: String,
    /// Backing file or block device (file backend).
    #[serde(default)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// Capacity: bytes, or with a unit (KiB, MiB, GiB, TiB, KB, MB, GB, TB).
    #[serde(default)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub size: Option<Size>,
    /// 512 or 4096.
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    /// Thin provisioning: UNMAP, WRITE SAME(UNMAP), GET LBA STATUS.
    #[serde(default = "yes")]
    pub thin: bool,
    /// Write-back cache; false = write-through (O_DSYNC).
    #[serde(default = "yes")]
    pub write_cache: bool,
    /// Refuse writes.
    #[serde(default)]
    pub read_only: bool,
    /// O_DIRECT.
    #[serde(default)]
    pub direct: bool,
    /// The largest transfer of one command, reported as the Block Limits page's MAXIMUM
    /// TRANSFER LENGTH: bytes, or with a unit; a multiple of block_size, at most 32 MiB (what
    /// one command may hold of a reactor's arena, the default).
    #[serde(default)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_transfer_length: Option<Size>,
    /// The transfer initiators should use, reported as OPTIMAL TRANSFER LENGTH: a multiple of
    /// block_size, at most max_transfer_length. Linux sizes its requests from it (it sends at
    /// most this much per command). Default 1 MiB, the default MaxBurstLength, so a write of
    /// this size is one burst of Data-Out.
    #[serde(default)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub optimal_transfer_length: Option<Size>,
    /// rbd: the pool holding the image.
    #[serde(default)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// rbd: the RADOS namespace within the pool; none when absent.
    #[serde(default)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// rbd: the image's name; created at `size` when it does not exist (an existing image is
    /// never resized to `size`).
    #[serde(default)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// rbd: the cluster's ceph.conf; librados' default search (CEPH_CONF,
    /// /etc/ceph/ceph.conf) when absent.
    #[serde(default)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ceph_conf: Option<PathBuf>,
    /// rbd: the cephx id, without "client." ("admin" when absent).
    #[serde(default)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client: Option<String>,
    /// rbd: the keyring with the client's key; the ceph.conf's keyring when absent.
    #[serde(default)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keyring: Option<PathBuf>,
    /// rbd: seconds a monitor or OSD may take to answer. A command whose I/O the cluster does
    /// not answer in time ends with NOT READY, LOGICAL UNIT IS IN PROCESS OF BECOMING READY,
    /// which initiators retry; targetd's start and `lun add` give up on an absent cluster
    /// after this long. Keep it below the initiator's command timeout (Linux: 30 s).
    #[serde(default, deserialize_with = "units::serde::optional_seconds")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ceph_timeout: Option<u64>,
    /// rbd in a `[cluster]`: the gateway (its `cluster.gateway`) that is active/optimized for
    /// this unit while it is live, so that units can be spread over the gateways; the live
    /// gateway with the lowest port group when absent or down.
    #[serde(default)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub preferred_gateway: Option<String>,
    /// rbd in a `[cluster]`: the live gateways other than the optimized one are standby for
    /// this unit (no media access through them until the optimized one goes) instead of
    /// active/non-optimized.
    #[serde(default)]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub standby: bool,
}

impl Config {
    /// `key` as an administrator names what it is about: a key of `targets[t]` or
    /// `targets[t].luns[l]` names the target and the LUN (`iqn.x:disk1 LUN 5: path`), as
    /// `targetctl` took them, rather than their places in the file's lists. Other keys are
    /// given as they are.
    pub fn describe_key(&self, key: &str) -> String {
        let index = |s: &str, prefix: &str| -> Option<(usize, String)> {
            let rest = s.strip_prefix(prefix)?;
            let (n, rest) = rest.split_once(']')?;
            Some((n.parse().ok()?, rest.trim_start_matches('.').to_string()))
        };
        let Some((t, rest)) = index(key, "targets[") else {
            return key.to_string();
        };
        let Some(target) = self.targets.get(t) else {
            return key.to_string();
        };
        match index(&rest, "luns[") {
            Some((l, what)) => match target.luns.get(l) {
                Some(lun) => format!("{} LUN {}: {what}", target.name, lun.lun),
                None => key.to_string(),
            },
            None => format!("target {}: {rest}", target.name),
        }
    }
}

/// This host's memory and swap in bytes (MemTotal and SwapTotal of /proc/meminfo); none where
/// they cannot be read.
fn host_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| {
                rest.trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
    };
    Some(kib("MemTotal:")?.saturating_add(kib("SwapTotal:").unwrap_or(0)) * 1024)
}

/// What holds a LUN's blocks, as the OS or the cluster names it, so that one file or image
/// backs at most one LUN however its path is written (relative or absolute, through `..`,
/// `.` or a symbolic link).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Backing {
    /// An existing file or device: its device and inode.
    Inode(u64, u64),
    /// A file still to be created: its directory made canonical, and its name.
    NewFile(PathBuf),
    /// An RBD image: `rbd:pool/namespace/image`.
    Rbd(String),
}

impl Backing {
    fn of_file(path: &Path) -> Backing {
        use std::os::unix::fs::MetadataExt;
        if let Ok(m) = std::fs::metadata(path) {
            return Backing::Inode(m.dev(), m.ino());
        }
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        match (std::fs::canonicalize(dir), path.file_name()) {
            (Ok(dir), Some(name)) => Backing::NewFile(dir.join(name)),
            _ => Backing::NewFile(path.to_path_buf()),
        }
    }
}

impl Server {
    /// The keys that take effect only at the next start and differ between `self` and
    /// `other`: (key, value here, value there), values as the config's Debug shows them.
    pub fn restart_only_differences(&self, other: &Server) -> Vec<(&'static str, String, String)> {
        let show = |v: &dyn std::fmt::Debug| format!("{v:?}");
        [
            (
                "rdma_portals",
                show(&self.rdma_portals),
                show(&other.rdma_portals),
            ),
            (
                "iser_portals",
                show(&self.iser_portals),
                show(&other.iser_portals),
            ),
            (
                "nvme_portals",
                show(&self.nvme_portals),
                show(&other.nvme_portals),
            ),
            (
                "nvme_rdma_portals",
                show(&self.nvme_rdma_portals),
                show(&other.nvme_rdma_portals),
            ),
            (
                "nvme_discovery_portals",
                show(&self.nvme_discovery_portals),
                show(&other.nvme_discovery_portals),
            ),
            ("reactors", show(&self.reactors), show(&other.reactors)),
            ("busy_poll", show(&self.busy_poll), show(&other.busy_poll)),
            (
                "srp_max_iu_len",
                show(&self.srp_max_iu_len),
                show(&other.srp_max_iu_len),
            ),
            (
                "srp_request_limit",
                show(&self.srp_request_limit),
                show(&other.srp_request_limit),
            ),
            (
                "srp_immediate_data",
                show(&self.srp_immediate_data),
                show(&other.srp_immediate_data),
            ),
            ("srp_ports", show(&self.srp_ports), show(&other.srp_ports)),
            ("engine", show(&self.engine), show(&other.engine)),
            (
                "admin_socket",
                show(&self.admin_socket),
                show(&other.admin_socket),
            ),
            (
                "metrics_listen",
                show(&self.metrics_listen),
                show(&other.metrics_listen),
            ),
            ("state_dir", show(&self.state_dir), show(&other.state_dir)),
            ("log", show(&self.log), show(&other.log)),
        ]
        .into_iter()
        .filter(|(_, a, b)| a != b)
        .collect()
    }
}

/// The keys of a `[[targets.luns]]` table.
pub const LUN_KEYS: &[&str] = &[
    "lun",
    "backend",
    "path",
    "size",
    "block_size",
    "thin",
    "write_cache",
    "read_only",
    "direct",
    "max_transfer_length",
    "optimal_transfer_length",
    "pool",
    "namespace",
    "image",
    "ceph_conf",
    "client",
    "keyring",
    "ceph_timeout",
    "preferred_gateway",
    "standby",
];

/// How long a Ceph cluster may take to answer when `ceph_timeout` is not set, seconds.
pub const DEFAULT_CEPH_TIMEOUT: u64 = 20;

/// The largest data transfer of one command, in bytes: a run of arena slots (half of a
/// reactor's default arena). 65536 blocks of 512 bytes, as libiscsi's tests move at once.
/// Units' `max_transfer` and `optimal_transfer` are checked against it.
pub const MAX_IO: u32 = 32 << 20;

/// OPTIMAL TRANSFER LENGTH when the config sets none, bytes.
pub const DEFAULT_OPTIMAL_TRANSFER: u64 = 1 << 20;

impl Lun {
    /// MAXIMUM and OPTIMAL TRANSFER LENGTH in blocks, as configured or by default (the optimal
    /// one never above the maximum).
    pub fn transfer_lengths(&self) -> (u32, u32) {
        let bs = u64::from(self.block_size.max(1));
        let max = self.max_transfer_length.map_or(u64::from(MAX_IO), |s| s.0);
        let optimal = self
            .optimal_transfer_length
            .map_or(DEFAULT_OPTIMAL_TRANSFER.min(max), |s| s.0);
        ((max / bs) as u32, (optimal / bs) as u32)
    }
}

fn default_block_size() -> u32 {
    512
}
fn yes() -> bool {
    true
}

/// A size in bytes, written as a number or a string with a unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size(pub u64);

impl Serialize for Size {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Size, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bytes(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Bytes(b) => Ok(Size(b)),
            Raw::Text(t) => parse_size(&t).map(Size).map_err(serde::de::Error::custom),
        }
    }
}

/// Parses "1GiB", "512 MiB", "4096", "10GB".
pub fn parse_size(text: &str) -> Result<u64, String> {
    units::parse_size(text)
}

/// Why `server.rdma_portals` cannot be served by this build on this machine, if it cannot:
/// without the feature `rdma`, or without an RDMA device.
fn rdma_unavailable() -> Option<String> {
    #[cfg(not(feature = "rdma"))]
    {
        Some(
            "RDMA (SRP, iSER and NVMe/RDMA) needs targetd built with the feature rdma \
             (cargo build --release --features rdma); this build has no RDMA support"
                .into(),
        )
    }
    #[cfg(feature = "rdma")]
    {
        match rdma::ibverbs::devices() {
            Err(e) => Some(format!("the RDMA devices cannot be listed: {e}")),
            Ok(d) if d.is_empty() => {
                Some("no RDMA device found on this machine (ibv_get_device_list is empty)".into())
            }
            Ok(_) => None,
        }
    }
}

impl Config {
    /// This config with every CHAP secret replaced by [`REDACTED`]: what may be shown (a
    /// config dump). It does not load back until the secrets are filled in.
    pub fn redacted(&self) -> Config {
        let mut c = self.clone();
        let hide = |chap: &mut Option<Chap>| {
            if let Some(chap) = chap {
                chap.secret = REDACTED.to_string();
            }
        };
        hide(&mut c.iscsi.discovery_chap);
        hide(&mut c.iscsi.discovery_mutual_chap);
        for t in &mut c.targets {
            hide(&mut t.chap);
            hide(&mut t.mutual_chap);
        }
        c
    }

    /// Reads, parses and validates `path`; relative paths in it are taken from the directory
    /// the file is in (the repo's config.toml, run from the repository, names `data/`).
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::parse(path, &text)
    }

    /// Parses and validates `text`, naming `path` in errors; relative paths in it are made
    /// relative to `path`'s directory.
    pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
        let mut config: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string().trim_end().to_string(),
        })?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            config.resolve_paths(dir);
        }
        config
            .validate()
            .map_err(|(key, reason)| ConfigError::Invalid {
                path: path.to_path_buf(),
                key,
                reason,
            })?;
        Ok(config)
    }

    /// Makes every relative path in the config relative to `dir` (the config file's): the
    /// admin socket, the state directory, file LUNs' paths, RBD LUNs' ceph.conf and keyring.
    /// A config means the same file wherever the daemon is started from.
    pub fn resolve_paths(&mut self, dir: &Path) {
        let fix = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = dir.join(&*p);
            }
        };
        fix(&mut self.server.admin_socket);
        if let Some(c) = self.cluster.as_mut() {
            for p in [&mut c.ceph_conf, &mut c.keyring].into_iter().flatten() {
                fix(p);
            }
        }
        if let Some(p) = self.server.state_dir.as_mut() {
            fix(p);
        }
        let luns = self.targets.iter_mut().flat_map(|t| t.luns.iter_mut());
        let namespaces = self
            .subsystems
            .iter_mut()
            .flat_map(|s| s.namespaces.iter_mut().map(|n| &mut n.unit));
        for lun in luns.chain(namespaces) {
            for p in [&mut lun.path, &mut lun.ceph_conf, &mut lun.keyring]
                .into_iter()
                .flatten()
            {
                fix(p);
            }
        }
    }

    /// What is allowed but worth a warning, as (key, reason): CHAP secrets longer than 16 bytes,
    /// which RFC 7143 allows but Windows and VMware initiators cannot be given. The daemon logs
    /// these at start and at every reload or live change.
    pub fn warnings(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        let mut chap = |key: String, c: &Option<Chap>| {
            if let Some(c) = c.as_ref().filter(|c| c.secret.len() > 16) {
                out.push((
                    format!("{key}.secret"),
                    format!(
                        "{} bytes: RFC 7143 allows it, but Windows and VMware initiators take at \
                         most 16",
                        c.secret.len()
                    ),
                ));
            }
        };
        chap("iscsi.discovery_chap".into(), &self.iscsi.discovery_chap);
        chap(
            "iscsi.discovery_mutual_chap".into(),
            &self.iscsi.discovery_mutual_chap,
        );
        for (t, target) in self.targets.iter().enumerate() {
            chap(format!("targets[{t}].chap"), &target.chap);
            chap(format!("targets[{t}].mutual_chap"), &target.mutual_chap);
        }
        out
    }

    /// The login negotiation settings `[iscsi]` describes.
    pub fn settings(&self) -> Settings {
        let i = &self.iscsi;
        let mut s = Settings {
            max_recv_data_segment_length: i.max_recv_data_segment_length,
            header_digest: i.header_digest.iter().filter_map(|d| digest(d)).collect(),
            data_digest: i.data_digest.iter().filter_map(|d| digest(d)).collect(),
            ..Settings::default()
        };
        let op = &mut s.operational;
        op.max_burst_length = i.max_burst_length;
        op.first_burst_length = i.first_burst_length;
        op.immediate_data = i.immediate_data;
        op.initial_r2t = i.initial_r2t;
        op.max_outstanding_r2t = i.max_outstanding_r2t;
        op.max_connections = i.max_connections;
        s
    }

    /// Every check beyond types: `Err((key, reason))`. Changes made at run time (targetctl,
    /// SIGHUP) go through it too.
    pub fn validate(&self) -> Result<(), (String, String)> {
        self.validate_server()?;
        self.validate_iscsi()?;
        self.validate_targets()?;
        self.validate_nvme()?;
        self.validate_cluster()
    }

    /// `[server]`: addresses, per-portal SRP terms, engine, timeouts, limits.
    fn validate_server(&self) -> Result<(), (String, String)> {
        let fail = |key: &str, reason: String| Err((key.to_string(), reason));
        let s = &self.server;
        if s.portals.is_empty() {
            return fail(
                "server.portals",
                "at least one listen address is needed".into(),
            );
        }
        for (i, p) in s.portals.iter().enumerate() {
            if p.parse::<SocketAddr>().is_err() {
                return fail(
                    &format!("server.portals[{i}]"),
                    format!("{p:?} is not an address:port"),
                );
            }
        }
        for (key, list) in [
            ("rdma_portals", &s.rdma_portals),
            ("iser_portals", &s.iser_portals),
            ("nvme_portals", &s.nvme_portals),
            ("nvme_rdma_portals", &s.nvme_rdma_portals),
            ("nvme_discovery_portals", &s.nvme_discovery_portals),
        ] {
            for (i, p) in list.iter().enumerate() {
                if p.parse::<SocketAddr>().is_err() {
                    return fail(
                        &format!("server.{key}[{i}]"),
                        format!("{p:?} is not an address:port"),
                    );
                }
            }
        }
        let terms = std::iter::once((
            "server.srp_".to_string(),
            Some(s.srp_max_iu_len),
            Some(s.srp_request_limit),
        ))
        .chain(s.srp_ports.iter().map(|(address, t)| {
            (
                format!("server.srp_ports.\"{address}\"."),
                t.max_iu_len,
                t.request_limit,
            )
        }));
        for (prefix, max_iu_len, request_limit) in terms {
            let (least, most) = (
                srp::target_port::MIN_IT_IU_LEN,
                rdma::verbs::MESSAGE_BUFFER_LEN as u32,
            );
            if let Some(n) = max_iu_len.filter(|n| !(least..=most).contains(n)) {
                return fail(
                    &format!("{prefix}max_iu_len"),
                    format!(
                        "{n}: must be {least} to {most} bytes (an SRP_CMD with a descriptor each \
                         way, to the size of the receive buffers)"
                    ),
                );
            }
            if let Some(n) = request_limit.filter(|n| !(1..=1024).contains(n)) {
                return fail(
                    &format!("{prefix}request_limit"),
                    format!("{n}: must be 1 to 1024 requests"),
                );
            }
        }
        for address in s.srp_ports.keys() {
            let named = address.parse::<SocketAddr>().ok().is_some_and(|a| {
                s.rdma_portals
                    .iter()
                    .any(|p| p.parse::<SocketAddr>().ok() == Some(a))
            });
            if !named {
                return fail(
                    &format!("server.srp_ports.\"{address}\""),
                    "no address of server.rdma_portals is this one".into(),
                );
            }
        }
        for (key, list) in [
            ("rdma_portals", &s.rdma_portals),
            ("iser_portals", &s.iser_portals),
            ("nvme_rdma_portals", &s.nvme_rdma_portals),
        ] {
            if !list.is_empty() {
                if let Some(why) = rdma_unavailable() {
                    return fail(&format!("server.{key}"), why);
                }
            }
        }
        if let Some(m) = &s.metrics_listen {
            if m.parse::<SocketAddr>().is_err() {
                return fail(
                    "server.metrics_listen",
                    format!("{m:?} is not an address:port"),
                );
            }
        }
        if !matches!(s.engine.as_str(), "auto" | "uring" | "threads") {
            return fail(
                "server.engine",
                format!(
                    "{:?}: expected \"auto\", \"uring\" or \"threads\"",
                    s.engine
                ),
            );
        }
        if s.nop_interval > 0 && s.nop_timeout == 0 {
            return fail(
                "server.nop_timeout",
                "must be at least 1 second when pings are on".into(),
            );
        }
        let timeouts = [
            ("server.login_timeout", s.login_timeout),
            ("server.send_timeout", s.send_timeout),
            ("server.data_out_timeout", s.data_out_timeout),
        ];
        for (key, seconds) in timeouts {
            if !(1..=3600).contains(&seconds) {
                return fail(key, format!("{seconds}: must be 1 to 3600 seconds"));
            }
        }
        if s.max_connections == 0 {
            return fail("server.max_connections", "must be at least 1".into());
        }
        if s.busy_poll > MAX_BUSY_POLL {
            return fail(
                "server.busy_poll",
                format!(
                    "{}: at most {} (a reactor polls this long after each request; longer \
                     only burns a core between bursts)",
                    units::format_duration(s.busy_poll),
                    units::format_duration(MAX_BUSY_POLL)
                ),
            );
        }
        if !(1..=iscsi_pdu::target_node::session::MAX_SESSIONS).contains(&s.max_sessions) {
            return fail(
                "server.max_sessions",
                format!(
                    "{}: must be 1 to {} (one per TSIH)",
                    s.max_sessions,
                    iscsi_pdu::target_node::session::MAX_SESSIONS
                ),
            );
        }
        Ok(())
    }

    /// `[[targets]]`: names, ACLs, CHAP, and each target's LUNs; a backing file or image
    /// backs one LUN of all targets at most.
    fn validate_targets(&self) -> Result<(), (String, String)> {
        let fail = |key: &str, reason: String| Err((key.to_string(), reason));
        let mut names = HashSet::new();
        let mut paths = HashSet::new();
        for (t, target) in self.targets.iter().enumerate() {
            let key = |k: &str| format!("targets[{t}].{k}");
            if let Err(why) = iscsi_pdu::names::check_iscsi_name(&target.name) {
                return fail(
                    &key("name"),
                    format!("{:?} is not an iSCSI name: {why}", target.name),
                );
            }
            if !names.insert(target.name.to_ascii_lowercase()) {
                return fail(&key("name"), format!("{:?} is defined twice", target.name));
            }
            for (i, ini) in target.initiators.iter().enumerate() {
                if let Err(why) = iscsi_pdu::names::check_iscsi_name(ini) {
                    return fail(
                        &key(&format!("initiators[{i}]")),
                        format!("{ini:?} is not an iSCSI name: {why}"),
                    );
                }
            }
            for (i, port) in target.srp_initiators.iter().enumerate() {
                if port.len() != 32 || !port.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return fail(
                        &key(&format!("srp_initiators[{i}]")),
                        format!("{port:?} is not an SRP initiator port identifier (32 hex digits)"),
                    );
                }
            }
            for (i, net) in target.networks.iter().enumerate() {
                if let Err(reason) = Network::parse(net) {
                    return fail(&key(&format!("networks[{i}]")), reason);
                }
            }
            check_chap(
                &format!("targets[{t}]."),
                ("chap", &target.chap),
                ("mutual_chap", &target.mutual_chap),
            )?;
            let mut luns = HashSet::new();
            for (l, lun) in target.luns.iter().enumerate() {
                self.validate_lun(t, l, lun, &mut luns, &mut paths)?;
            }
        }
        self.validate_subsystems(&mut paths)?;
        self.validate_memory_units(host_memory())
    }

    /// `[nvme]`: what the controllers offer.
    fn validate_nvme(&self) -> Result<(), (String, String)> {
        let n = &self.nvme;
        let fail = |key: &str, reason: String| Err((format!("nvme.{key}"), reason));
        if n.in_capsule_data_size % 16 != 0 || n.in_capsule_data_size > 131_072 {
            return fail(
                "in_capsule_data_size",
                format!(
                    "{}: must be a multiple of 16 bytes, at most 131072",
                    n.in_capsule_data_size
                ),
            );
        }
        let rdma_most = crate::fabric::NVME_MAX_IN_CAPSULE_DATA;
        if !self.server.nvme_rdma_portals.is_empty() && n.in_capsule_data_size > rdma_most {
            return fail(
                "in_capsule_data_size",
                format!(
                    "{}: at most {rdma_most} bytes with server.nvme_rdma_portals (a capsule is \
                     received into one message buffer)",
                    n.in_capsule_data_size
                ),
            );
        }
        if !(1..=128).contains(&n.max_io_queues) {
            return fail(
                "max_io_queues",
                format!("{}: must be 1 to 128", n.max_io_queues),
            );
        }
        if !(32..=1024).contains(&n.queue_entries) {
            return fail(
                "queue_entries",
                format!("{}: must be 32 to 1024", n.queue_entries),
            );
        }
        if !(4096..=1 << 20).contains(&n.max_h2c_data) || n.max_h2c_data % 4 != 0 {
            return fail(
                "max_h2c_data",
                format!(
                    "{}: must be a multiple of 4 bytes from 4096 to 1048576",
                    n.max_h2c_data
                ),
            );
        }
        Ok(())
    }

    /// `[[subsystems]]`: NQNs, hosts, identity strings, and each namespace (its NSID, and
    /// its storage as a LUN's: `paths` holds what the LUNs use already).
    fn validate_subsystems(&self, paths: &mut HashSet<Backing>) -> Result<(), (String, String)> {
        let fail = |key: String, reason: String| Err((key, reason));
        let mut nqns = HashSet::new();
        for (i, sub) in self.subsystems.iter().enumerate() {
            let key = |k: &str| format!("subsystems[{i}].{k}");
            if let Err(why) = nvme::fabrics::check_nqn(&sub.nqn) {
                return fail(key("nqn"), format!("{:?} is not an NQN: {why}", sub.nqn));
            }
            if sub.nqn == nvme::fabrics::DISCOVERY_NQN {
                return fail(
                    key("nqn"),
                    "is the discovery controllers' NQN, which no NVM subsystem may have".into(),
                );
            }
            if !nqns.insert(sub.nqn.as_str()) {
                return fail(key("nqn"), format!("{:?} is defined twice", sub.nqn));
            }
            for (h, host) in sub.hosts.iter().enumerate() {
                if let Err(why) = nvme::fabrics::check_nqn(host) {
                    return fail(
                        key(&format!("hosts[{h}]")),
                        format!("{host:?} is not a host NQN: {why}"),
                    );
                }
            }
            for (k, value, most) in [("serial", &sub.serial, 20), ("model", &sub.model, 40)] {
                if let Some(v) = value {
                    if v.is_empty()
                        || v.len() > most
                        || !v.bytes().all(|b| (0x20..0x7f).contains(&b))
                    {
                        return fail(
                            key(k),
                            format!("{v:?}: must be 1 to {most} printable ASCII characters"),
                        );
                    }
                }
            }
            let mut nsids = HashSet::new();
            for (n, ns) in sub.namespaces.iter().enumerate() {
                let nkey = |k: &str| format!("subsystems[{i}].namespaces[{n}].{k}");
                if !(1..=MAX_NSID).contains(&ns.nsid) {
                    return fail(
                        nkey("nsid"),
                        format!("{}: must be 1 to {MAX_NSID}", ns.nsid),
                    );
                }
                if !nsids.insert(ns.nsid) {
                    return fail(
                        nkey("nsid"),
                        format!("namespace {} is defined twice in this subsystem", ns.nsid),
                    );
                }
                self.validate_unit(&nkey, &ns.unit, paths)?;
            }
        }
        Ok(())
    }

    /// Memory units hold every block written in the daemon's RAM: together they must fit in
    /// what the host has (`host` bytes of memory and swap; unknown: not checked), or writes
    /// would end with the daemon killed for lack of memory, losing every unit's data.
    fn validate_memory_units(&self, host: Option<u64>) -> Result<(), (String, String)> {
        let Some(host) = host else { return Ok(()) };
        let mut total = 0u64;
        let luns = self.targets.iter().enumerate().flat_map(|(t, target)| {
            target
                .luns
                .iter()
                .enumerate()
                .map(move |(l, lun)| (format!("targets[{t}].luns[{l}].size"), lun))
        });
        let namespaces = self.subsystems.iter().enumerate().flat_map(|(i, sub)| {
            sub.namespaces
                .iter()
                .enumerate()
                .map(move |(n, ns)| (format!("subsystems[{i}].namespaces[{n}].size"), &ns.unit))
        });
        {
            for (key, lun) in luns.chain(namespaces) {
                let (true, Some(Size(size))) = (lun.backend == "memory", lun.size) else {
                    continue;
                };
                total = total.saturating_add(size);
                if total > host {
                    let others = total - size;
                    return Err((
                        key,
                        format!(
                            "a memory LUN of {} {}is more than this host's {} of memory and \
                             swap: its blocks live in targetd's memory, and writing them would \
                             get the daemon killed (use the file backend for a disk this large)",
                            units::format_size(size),
                            if others > 0 {
                                format!(
                                    "beside {} of other memory LUNs ",
                                    units::format_size(others)
                                )
                            } else {
                                String::new()
                            },
                            units::format_size(host)
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// `targets[t].luns[l]`: number, geometry, transfer lengths, and its backend's keys.
    fn validate_lun(
        &self,
        t: usize,
        l: usize,
        lun: &Lun,
        luns: &mut HashSet<u16>,
        paths: &mut HashSet<Backing>,
    ) -> Result<(), (String, String)> {
        let fail = |key: &str, reason: String| Err((key.to_string(), reason));
        let key = |k: &str| format!("targets[{t}].luns[{l}].{k}");
        if lun.lun > scsi_core::MAX_LUN {
            return fail(
                &key("lun"),
                format!("{} exceeds {}", lun.lun, scsi_core::MAX_LUN),
            );
        }
        if !luns.insert(lun.lun) {
            return fail(
                &key("lun"),
                format!("LUN {} is defined twice in this target", lun.lun),
            );
        }
        self.validate_unit(&key, lun, paths)
    }

    /// A unit's geometry, transfer lengths and backend keys (a LUN's or a namespace's; `key`
    /// names them); the file or image backs no other unit.
    fn validate_unit(
        &self,
        key: &dyn Fn(&str) -> String,
        lun: &Lun,
        paths: &mut HashSet<Backing>,
    ) -> Result<(), (String, String)> {
        let fail = |key: &str, reason: String| Err((key.to_string(), reason));
        if lun.block_size != 512 && lun.block_size != 4096 {
            return fail(
                &key("block_size"),
                format!("{}: must be 512 or 4096", lun.block_size),
            );
        }
        let bs = u64::from(lun.block_size);
        let max_io = u64::from(MAX_IO);
        if let Some(Size(max)) = lun.max_transfer_length {
            if max == 0 || max % bs != 0 || max > max_io {
                return fail(
                    &key("max_transfer_length"),
                    format!(
                        "{max} is not a non-zero multiple of block_size {bs} of at most \
                         {max_io} (the largest transfer of one command)"
                    ),
                );
            }
        }
        if let Some(Size(optimal)) = lun.optimal_transfer_length {
            let max = u64::from(lun.transfer_lengths().0) * bs;
            if optimal == 0 || optimal % bs != 0 || optimal > max {
                return fail(
                    &key("optimal_transfer_length"),
                    format!(
                        "{optimal} is not a non-zero multiple of block_size {bs} of at \
                         most the maximum transfer length {max}"
                    ),
                );
            }
        }
        if let Some(Size(size)) = lun.size {
            if size == 0 || size % u64::from(lun.block_size) != 0 {
                return fail(
                    &key("size"),
                    format!(
                        "{size} is not a non-zero multiple of block_size {}",
                        lun.block_size
                    ),
                );
            }
        }
        let rbd_keys = [
            ("pool", lun.pool.is_some()),
            ("namespace", lun.namespace.is_some()),
            ("image", lun.image.is_some()),
            ("ceph_conf", lun.ceph_conf.is_some()),
            ("client", lun.client.is_some()),
            ("keyring", lun.keyring.is_some()),
            ("ceph_timeout", lun.ceph_timeout.is_some()),
            ("preferred_gateway", lun.preferred_gateway.is_some()),
            ("standby", lun.standby),
        ];
        if lun.backend != "rbd" {
            if let Some((k, _)) = rbd_keys.iter().find(|(_, set)| *set) {
                return fail(
                    &key(k),
                    format!("only the rbd backend has {k} (this LUN is {})", lun.backend),
                );
            }
        }
        match lun.backend.as_str() {
            "rbd" => self.validate_rbd(key, lun, paths)?,
            "file" => {
                let Some(path) = &lun.path else {
                    return fail(&key("path"), "the file backend needs a path".into());
                };
                if !paths.insert(Backing::of_file(path)) {
                    return fail(
                        &key("path"),
                        format!("{} backs another LUN or namespace already", path.display()),
                    );
                }
            }
            "memory" | "null" => {
                if lun.size.is_none() {
                    return fail(
                        &key("size"),
                        format!("the {} backend needs a size", lun.backend),
                    );
                }
                if lun.path.is_some() {
                    return fail(
                        &key("path"),
                        format!("the {} backend has no path", lun.backend),
                    );
                }
            }
            other => {
                return fail(
                    &key("backend"),
                    format!("{other:?}: expected \"file\", \"memory\", \"null\" or \"rbd\""),
                )
            }
        }
        Ok(())
    }

    /// An rbd LUN's keys (`key` names them): pool, image and the other names, the cephx
    /// client, timeouts, its ALUA choices (which need a cluster), one LUN per image.
    fn validate_rbd(
        &self,
        key: &dyn Fn(&str) -> String,
        lun: &Lun,
        paths: &mut HashSet<Backing>,
    ) -> Result<(), (String, String)> {
        let fail = |key: &str, reason: String| Err((key.to_string(), reason));
        if !cfg!(feature = "rbd") {
            return fail(
                &key("backend"),
                "\"rbd\": this targetd was built without the feature rbd \
                 (cargo build --release --features rbd; needs librbd-dev)"
                    .into(),
            );
        }
        if lun.path.is_some() {
            return fail(
                &key("path"),
                "the rbd backend has no path: it names pool and image".into(),
            );
        }
        if lun.direct {
            return fail(
                &key("direct"),
                "the rbd backend has no page cache to bypass".into(),
            );
        }
        for (k, v) in [
            ("pool", &lun.pool),
            ("image", &lun.image),
            ("namespace", &lun.namespace),
            ("client", &lun.client),
        ] {
            match v {
                None if k == "pool" || k == "image" => {
                    return fail(&key(k), format!("the rbd backend needs {k}"));
                }
                Some(v) if v.is_empty() || v.contains(['/', '@', '\0']) || v.trim() != v => {
                    return fail(
                        &key(k),
                        format!("{v:?}: must be a non-empty name without '/', '@' or spaces at either end"),
                    );
                }
                _ => {}
            }
        }
        if let Some(c) = &lun.client {
            if c.starts_with("client.") {
                return fail(
                    &key("client"),
                    format!("{c:?}: give the cephx id without \"client.\""),
                );
            }
        }
        if let Some(t) = lun.ceph_timeout {
            if !(1..=3600).contains(&t) {
                return fail(
                    &key("ceph_timeout"),
                    format!("{t}: must be 1 to 3600 seconds"),
                );
            }
        }
        for (k, set) in [
            ("preferred_gateway", lun.preferred_gateway.is_some()),
            ("standby", lun.standby),
        ] {
            if set && self.cluster.is_none() {
                return fail(
                    &key(k),
                    "only a unit that a [cluster] of gateways shares has ALUA \
                     states to choose"
                        .into(),
                );
            }
        }
        if let Some(g) = &lun.preferred_gateway {
            if g.is_empty() || g.contains(char::is_whitespace) {
                return fail(
                    &key("preferred_gateway"),
                    format!("{g:?}: must be a gateway's name (cluster.gateway)"),
                );
            }
        }
        let spec = format!(
            "rbd:{}/{}/{}",
            lun.pool.as_deref().unwrap_or_default(),
            lun.namespace.as_deref().unwrap_or_default(),
            lun.image.as_deref().unwrap_or_default()
        );
        if !paths.insert(Backing::Rbd(spec.clone())) {
            return fail(
                &key("image"),
                format!("{} backs another LUN or namespace already", &spec[4..]),
            );
        }
        Ok(())
    }

    fn validate_cluster(&self) -> Result<(), (String, String)> {
        let Some(c) = &self.cluster else {
            return Ok(());
        };
        let fail = |key: &str, reason: String| Err((format!("cluster.{key}"), reason));
        if !cfg!(feature = "rbd") {
            return Err((
                "cluster".into(),
                "this targetd was built without the feature rbd, which keeps a cluster's \
                 state in RADOS (cargo build --release --features rbd; needs librbd-dev)"
                    .into(),
            ));
        }
        for (k, v) in [
            ("name", Some(&c.name)),
            ("gateway", Some(&c.gateway)),
            ("pool", Some(&c.pool)),
            ("namespace", c.namespace.as_ref()),
            ("client", c.client.as_ref()),
        ] {
            if let Some(v) = v {
                if v.is_empty() || v.contains(['/', '@', '\0']) || v.trim() != v {
                    return fail(
                        k,
                        format!("{v:?}: must be a non-empty name without '/', '@' or spaces at either end"),
                    );
                }
            }
        }
        if let Some(id) = &c.client {
            if id.starts_with("client.") {
                return fail(
                    "client",
                    format!("{id:?}: give the cephx id without \"client.\""),
                );
            }
        }
        if c.port_group == 0 {
            return fail("port_group", "0: must be 1 to 65535".into());
        }
        let nvme = !self.subsystems.is_empty() || !self.server.nvme_portals.is_empty();
        if nvme && crate::nvme::controller_ids(Some(c.port_group)).is_none() {
            return fail(
                "port_group",
                format!(
                    "{}: with NVMe subsystems, must be 1 to {} (each gateway's NVMe controllers \
                     take {} controller IDs of their own: a host connected to several gateways \
                     refuses two with one ID)",
                    c.port_group,
                    crate::nvme::MAX_NVME_PORT_GROUP,
                    crate::nvme::CNTLIDS_PER_GATEWAY
                ),
            );
        }
        if !self.server.rdma_portals.is_empty()
            && cluster::member::srp_relative_port(c.port_group).is_none()
        {
            return fail(
                "port_group",
                format!(
                    "{}: with server.rdma_portals, must be 1 to 32767 (the SRP port's relative \
                     port identifier is 32768 + port_group)",
                    c.port_group
                ),
            );
        }
        if let Some(t) = c.ceph_timeout {
            if !(1..=3600).contains(&t) {
                return fail("ceph_timeout", format!("{t}: must be 1 to 3600 seconds"));
            }
        }
        if !(1..=300).contains(&c.notify_timeout) {
            return fail(
                "notify_timeout",
                format!("{}: must be 1 to 300 seconds", c.notify_timeout),
            );
        }
        let (least, most) = (Duration::from_millis(100), Duration::from_secs(60));
        for (key, d) in [
            ("membership_interval", c.membership_interval),
            ("membership_timeout", c.membership_timeout),
        ] {
            if d < least || d > most {
                return fail(
                    key,
                    format!("{}: must be 100ms to 60s", units::format_duration(d)),
                );
            }
        }
        Ok(())
    }

    fn validate_iscsi(&self) -> Result<(), (String, String)> {
        let i = &self.iscsi;
        check_chap(
            "iscsi.",
            ("discovery_chap", &i.discovery_chap),
            ("discovery_mutual_chap", &i.discovery_mutual_chap),
        )?;
        for (k, list) in [
            ("header_digest", &i.header_digest),
            ("data_digest", &i.data_digest),
        ] {
            if list.is_empty() {
                return Err((
                    format!("iscsi.{k}"),
                    "at least one of \"None\", \"CRC32C\"".into(),
                ));
            }
            for v in list {
                if digest(v).is_none() {
                    return Err((
                        format!("iscsi.{k}"),
                        format!("{v:?}: expected \"None\" or \"CRC32C\""),
                    ));
                }
            }
        }
        if !(1..=(1u32 << 31)).contains(&i.cmdsn_window) {
            return Err((
                "iscsi.cmdsn_window".into(),
                format!("{} is outside 1..=2^31", i.cmdsn_window),
            ));
        }
        // The RFC's ranges, checked once by iscsi-pdu, reported under the config's key names.
        self.settings().validate().map_err(|e| {
            let key = match e.key {
                "MaxRecvDataSegmentLength" => "max_recv_data_segment_length",
                "MaxBurstLength" => "max_burst_length",
                "FirstBurstLength" => "first_burst_length",
                "MaxOutstandingR2T" => "max_outstanding_r2t",
                "MaxConnections" => "max_connections",
                other => other,
            };
            (format!("iscsi.{key}"), e.reason)
        })
    }
}

/// Checks a CHAP pair: each secret at least 12 bytes (RFC 7143 section 12.1.3 asks for at
/// least 96 bits; a longer one than 16 bytes is allowed, as the RFC allows, and
/// [`Config::warnings`] mentions it); mutual CHAP only with CHAP and with a different secret.
/// `prefix` and the names make the keys of the messages.
fn check_chap(
    prefix: &str,
    one_way: (&str, &Option<Chap>),
    mutual: (&str, &Option<Chap>),
) -> Result<(), (String, String)> {
    let key = |k: &str| format!("{prefix}{k}");
    for (k, chap) in [one_way, mutual] {
        if let Some(c) = chap {
            if c.username.is_empty() {
                return Err((key(&format!("{k}.username")), "must not be empty".into()));
            }
            if c.secret.len() < 12 {
                return Err((
                    key(&format!("{k}.secret")),
                    format!(
                        "{} bytes: must be at least 12 (RFC 7143 section 12.1.3)",
                        c.secret.len()
                    ),
                ));
            }
        }
    }
    match (one_way.1, mutual.1) {
        (None, Some(_)) => Err((
            key(mutual.0),
            format!("needs {} (the initiator authenticates first)", one_way.0),
        )),
        (Some(a), Some(b)) if a.secret == b.secret => Err((
            key(&format!("{}.secret", mutual.0)),
            format!(
                "must differ from {}.secret (RFC 7143 section 12.1.3)",
                one_way.0
            ),
        )),
        _ => Ok(()),
    }
}

fn digest(v: &str) -> Option<DigestAlgorithm> {
    match v {
        "None" => Some(DigestAlgorithm::None),
        "CRC32C" => Some(DigestAlgorithm::Crc32c),
        _ => None,
    }
}

/// A source network an initiator may connect from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Network {
    addr: IpAddr,
    prefix: u8,
}

impl Network {
    /// Parses "10.0.0.0/8", "::1/128" or a bare address (a single host).
    pub fn parse(text: &str) -> Result<Network, String> {
        let (a, p) = match text.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (text, None),
        };
        let addr: IpAddr = a
            .parse()
            .map_err(|_| format!("{text:?} is not an address or CIDR network"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match p {
            None => max,
            Some(p) => p
                .parse::<u8>()
                .ok()
                .filter(|&n| n <= max)
                .ok_or_else(|| format!("{text:?}: prefix length must be 0..={max}"))?,
        };
        Ok(Network { addr, prefix })
    }

    /// Whether `ip` is in this network (IPv4-mapped IPv6 addresses count as IPv4).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        match (self.addr, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(n) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(n) & mask == u128::from(a) & mask
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[server]
portals = ["127.0.0.1:3260"]
admin_socket = "targetd.sock"

[[targets]]
name = "iqn.2026-11.io.example:disk1"

[[targets.luns]]
lun = 0
backend = "file"
path = "data/disk1.img"
size = "1GiB"
"#;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(Path::new("config.toml"), text)
    }

    fn refused(text: &str) -> String {
        parse(text).expect_err("must be refused").to_string()
    }

    #[test]
    fn the_repo_config_parses() {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config.toml");
        let c = Config::load(&repo).unwrap();
        let lun = &c.targets[0].luns[0];
        assert_eq!(
            (lun.backend.as_str(), lun.size),
            ("file", Some(Size(1 << 30)))
        );
        assert_eq!(c.server.portals, ["127.0.0.1:3260"]);
        let c = parse(GOOD).unwrap();
        assert_eq!(c.iscsi, Iscsi::default());
        assert_eq!((c.server.engine.as_str(), c.server.reactors), ("auto", 0));
        let s = c.settings();
        assert_eq!(s.operational.first_burst_length, 262_144);
        assert_eq!(
            s.data_digest,
            [DigestAlgorithm::None, DigestAlgorithm::Crc32c]
        );
    }

    const SUBSYSTEM: &str = r#"
[[subsystems]]
nqn = "nqn.2026-11.io.example:ssd"
hosts = ["nqn.2014-08.org.nvmexpress:uuid:0b2b1f8e-0000-4000-8000-000000000001"]

[[subsystems.namespaces]]
nsid = 1
backend = "memory"
size = "64MiB"

[[subsystems.namespaces]]
nsid = 2
backend = "file"
path = "data/ns2.img"
size = "1GiB"
block_size = 4096
"#;

    #[test]
    fn subsystems_and_their_namespaces_are_checked_key_by_key() {
        let text = format!("{GOOD}{SUBSYSTEM}");
        let c = parse(&text).expect("a good subsystem");
        let sub = &c.subsystems[0];
        assert_eq!(sub.namespaces.len(), 2);
        let ns = &sub.namespaces[1];
        assert_eq!((ns.nsid, ns.unit.block_size), (2, 4096));
        assert!(ns.unit.path.as_ref().unwrap().ends_with("data/ns2.img"));
        assert_eq!(c.nvme, Nvme::default());
        // Written back as it was read: nsid, not lun.
        let written = toml::to_string(&c).unwrap();
        assert!(
            written.contains("nsid = 2") && !written.contains("lun = 2"),
            "{written}"
        );
        assert_eq!(parse(&written).unwrap().subsystems, c.subsystems);
        for (from, to, key) in [
            (
                "nqn = \"nqn.2026-11.io.example:ssd\"",
                "nqn = \"iqn.2026-11.x:y\"",
                "subsystems[0].nqn",
            ),
            (
                "hosts = [\"nqn.2014",
                "hosts = [\"host\", \"nqn.2014",
                "subsystems[0].hosts[0]",
            ),
            ("nsid = 2", "nsid = 1", "subsystems[0].namespaces[1].nsid"),
            ("nsid = 2", "nsid = 0", "subsystems[0].namespaces[1].nsid"),
            (
                "block_size = 4096",
                "block_size = 1000",
                "subsystems[0].namespaces[1].block_size",
            ),
            (
                "size = \"64MiB\"",
                "size = 1000",
                "subsystems[0].namespaces[0].size",
            ),
            (
                "path = \"data/ns2.img\"",
                "path = \"data/disk1.img\"",
                "subsystems[0].namespaces[1].path",
            ),
            (
                "nsid = 1\n",
                "nsid = 1\nstandby = true\n",
                "subsystems[0].namespaces[0].standby",
            ),
            (
                "hosts = [",
                "serial = \"\"\nhosts = [",
                "subsystems[0].serial",
            ),
        ] {
            assert!(text.contains(from), "{from}");
            let e = refused(&text.replacen(from, to, 1));
            assert!(e.contains(key), "{key}: {e}");
        }
        // A namespace has no `lun`, and an unknown key is named.
        let e = refused(&text.replace("nsid = 1\n", "nsid = 1\nlun = 3\n"));
        assert!(e.contains("lun") && e.contains("nsid"), "{e}");
        let e = refused(&text.replace("nsid = 1\n", "nsid = 1\ncolour = 3\n"));
        assert!(e.contains("colour"), "{e}");
        let e = refused(&format!("{text}\n[nvme]\nqueue_entries = 8\n"));
        assert!(e.contains("nvme.queue_entries"), "{e}");
        let e = refused(&text.replace(
            "portals = [\"127.0.0.1:3260\"]",
            "portals = [\"127.0.0.1:3260\"]\nnvme_portals = [\"nowhere\"]",
        ));
        assert!(e.contains("server.nvme_portals[0]"), "{e}");
    }

    #[test]
    fn unknown_keys_and_types_are_refused_with_their_place() {
        let e = refused(&GOOD.replace("admin_socket", "admin_sockte"));
        assert!(
            e.contains("admin_sockte") && e.contains("config.toml"),
            "{e}"
        );
        let e = refused(&GOOD.replace("lun = 0", "lun = 0\ncolour = \"red\""));
        assert!(e.contains("colour"), "{e}");
        let e = refused(&GOOD.replace("lun = 0", "lun = \"zero\""));
        assert!(e.contains("line"), "{e}");
    }

    /// A config that names RDMA portals is refused, with the reason, unless this build can
    /// serve them (the feature `rdma` and a device).
    #[test]
    fn a_cluster_is_checked_key_by_key() {
        let cluster =
            "\n[cluster]\nname = \"gws\"\ngateway = \"a\"\nport_group = 2\npool = \"rbd\"\n";
        let text = format!("{GOOD}{cluster}");
        if !cfg!(feature = "rbd") {
            let e = refused(&text);
            assert!(e.contains("cluster") && e.contains("feature rbd"), "{e}");
            return;
        }
        let c = parse(&text).expect("a good cluster");
        let cl = c.cluster.clone().expect("parsed");
        assert_eq!((cl.port_group, cl.notify_timeout), (2, 5));
        assert_eq!(
            (cl.membership_interval, cl.membership_timeout),
            (Duration::from_millis(500), Duration::from_secs(1))
        );
        let tuned = parse(&text.replace(
            "pool = \"rbd\"",
            "pool = \"rbd\"\nmembership_interval = \"250ms\"\nmembership_timeout = 2",
        ))
        .expect("tuned")
        .cluster
        .expect("parsed");
        assert_eq!(
            (tuned.membership_interval, tuned.membership_timeout),
            (Duration::from_millis(250), Duration::from_secs(2))
        );
        for (from, to, key) in [
            ("port_group = 2", "port_group = 0", "cluster.port_group"),
            ("gateway = \"a\"", "gateway = \"a/b\"", "cluster.gateway"),
            (
                "pool = \"rbd\"",
                "pool = \"rbd\"\nclient = \"client.x\"",
                "cluster.client",
            ),
            (
                "pool = \"rbd\"",
                "pool = \"rbd\"\nnotify_timeout = 0",
                "cluster.notify_timeout",
            ),
            (
                "pool = \"rbd\"",
                "pool = \"rbd\"\nceph_timeout = 0",
                "cluster.ceph_timeout",
            ),
            (
                "pool = \"rbd\"",
                "pool = \"rbd\"\nmembership_interval = \"10ms\"",
                "cluster.membership_interval",
            ),
            (
                "pool = \"rbd\"",
                "pool = \"rbd\"\nmembership_timeout = \"2m\"",
                "cluster.membership_timeout",
            ),
            (
                "pool = \"rbd\"",
                "pool = \"rbd\"\nmembership_timeout = \"soon\"",
                "membership_timeout",
            ),
            ("pool = \"rbd\"\n", "", "pool"),
        ] {
            let e = refused(&text.replace(from, to));
            assert!(e.contains(key), "{to}: {e}");
        }
        // SRP ports join a cluster: their relative port is 32768 + port_group. (The cluster's
        // checks alone: the RDMA portals' own need a device this machine may not have.)
        let mut srp = c.clone();
        srp.server.rdma_portals = vec!["127.0.0.1:5555".into()];
        srp.validate_cluster().expect("SRP ports in a cluster");
        srp.cluster.as_mut().expect("parsed").port_group = 40000;
        let (key, reason) = srp
            .validate_cluster()
            .expect_err("no room for the SRP port");
        assert_eq!(key, "cluster.port_group");
        assert!(reason.contains("32767"), "{reason}");
        // NVMe gateways need a range of controller IDs of their own.
        let mut nvme = c.clone();
        nvme.server.nvme_portals = vec!["127.0.0.1:4420".into()];
        nvme.cluster.as_mut().expect("parsed").port_group = 63;
        nvme.validate_cluster().expect("port group 63 with NVMe");
        nvme.cluster.as_mut().expect("parsed").port_group = 64;
        let (key, reason) = nvme.validate_cluster().expect_err("no controller IDs left");
        assert_eq!(key, "cluster.port_group");
        assert!(reason.contains("1 to 63"), "{reason}");
    }

    /// docs/config.md names every key targetd reads, and nothing else; its examples parse.
    #[test]
    fn the_config_reference_names_every_key() {
        use std::collections::{BTreeMap, BTreeSet};
        let doc = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/config.md"),
        )
        .expect("docs/config.md");
        // The keys its tables document, by section.
        let mut documented: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
        let mut section = "";
        for line in doc.lines() {
            if let Some(h) = line.strip_prefix("## ") {
                section = h.trim_matches('`');
            } else if line.starts_with("A CHAP table") {
                section = "chap";
            } else if line.starts_with("An SRP port's table") {
                section = "srp_ports";
            } else if let Some(rest) = line.strip_prefix("| `") {
                let key = rest.split('`').next().unwrap_or_default().to_string();
                documented.entry(section).or_default().insert(key);
            }
        }
        // The keys its examples set, by section, as targetd reads them back.
        let mut seen: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
        let keys = |v: &toml::Value| -> Vec<String> {
            v.as_table()
                .map(|t| t.keys().cloned().collect())
                .unwrap_or_default()
        };
        let mut examples = 0;
        let mut srp_ports_seen = false;
        for block in doc.split("```toml\n").skip(1) {
            let text = block.split("```").next().unwrap_or_default();
            let needs_rbd = text.contains("[cluster]") || text.contains("backend = \"rbd\"");
            if needs_rbd && !cfg!(feature = "rbd") {
                continue;
            }
            // RDMA portals are refused where this build or host has no RDMA.
            if text.contains("rdma_portals = [\"") && rdma_unavailable().is_some() {
                continue;
            }
            let config = parse(text).unwrap_or_else(|e| panic!("an example: {e}\n{text}"));
            examples += 1;
            let v = toml::Value::try_from(&config).expect("serializes");
            let mut add = |section, names: Vec<String>| {
                seen.entry(section).or_default().extend(names);
            };
            add("[server]", keys(&v["server"]));
            if let Some(ports) = v["server"].get("srp_ports").and_then(|p| p.as_table()) {
                srp_ports_seen = true;
                for port in ports.values() {
                    add("srp_ports", keys(port));
                }
            }
            add("[iscsi]", keys(&v["iscsi"]));
            for chap in ["discovery_chap", "discovery_mutual_chap"] {
                if let Some(c) = v["iscsi"].get(chap) {
                    add("chap", keys(c));
                }
            }
            // Each table of the array `name` in `v`, and each of the array `inner` in it.
            let mut nested = |name: &str, inner: &str, outer_key, inner_key| {
                let tables = |v: &toml::Value, k: &str| {
                    v.get(k)
                        .and_then(|t| t.as_array())
                        .cloned()
                        .unwrap_or_default()
                };
                for t in tables(&v, name) {
                    add(outer_key, keys(&t));
                    for l in tables(&t, inner) {
                        add(inner_key, keys(&l));
                    }
                }
            };
            nested("targets", "luns", "[[targets]]", "[[targets.luns]]");
            nested(
                "subsystems",
                "namespaces",
                "[[subsystems]]",
                "[[subsystems.namespaces]]",
            );
            if let Some(c) = v.get("cluster") {
                add("[cluster]", keys(c));
            }
            if let Some(n) = v.get("nvme") {
                add("[nvme]", keys(n));
            }
        }
        assert!(examples >= 3, "the examples were found");
        if !srp_ports_seen {
            // Its example was not parsed here: the key is checked where RDMA is.
            documented
                .get_mut("[server]")
                .expect("the server's keys")
                .remove("srp_ports");
        }
        for (section, names) in &seen {
            let doc = documented.get(section).cloned().unwrap_or_default();
            if *section == "[[targets.luns]]" && !cfg!(feature = "rbd") {
                // The RBD example is not parsed without the feature: its keys are checked
                // against LUN_KEYS below.
                assert!(names.is_subset(&doc), "{section}: {names:?} not in {doc:?}");
            } else {
                assert_eq!(
                    &doc, names,
                    "{section}: the reference's keys, then those its examples set"
                );
            }
        }
        let luns: BTreeSet<String> = LUN_KEYS.iter().map(|k| k.to_string()).collect();
        assert_eq!(documented.get("[[targets.luns]]"), Some(&luns));
        let sections = if cfg!(feature = "rbd") { 9 } else { 8 } + usize::from(srp_ports_seen);
        assert_eq!(seen.len(), sections, "every section was checked: {seen:?}");
    }

    #[test]
    fn sizes_and_durations_have_one_grammar() {
        let with = |line: &str| {
            GOOD.replace(
                "admin_socket = \"targetd.sock\"",
                &format!("admin_socket = \"targetd.sock\"\n{line}"),
            )
        };
        let c = parse(&with(
            "nop_interval = \"2m\"\nlogin_timeout = \"1m30s\"\nsend_timeout = 45",
        ))
        .expect("durations");
        assert_eq!(
            (
                c.server.nop_interval,
                c.server.login_timeout,
                c.server.send_timeout
            ),
            (120, 90, 45)
        );
        let e = refused(&with("login_timeout = \"1.5s\""));
        assert!(
            e.contains("login_timeout") && e.contains("whole seconds"),
            "{e}"
        );
        let e = refused(&with("nop_timeout = \"soon\""));
        assert!(
            e.contains("nop_timeout") && e.contains("not a duration"),
            "{e}"
        );
        // 1G is 2^30 here as in targetctl and initiator-bench; 1GB is 10^9.
        let c = parse(&GOOD.replace("size = \"1GiB\"", "size = \"1G\"")).expect("1G");
        assert_eq!(c.targets[0].luns[0].size, Some(Size(1 << 30)));
        let c = parse(&GOOD.replace("size = \"1GiB\"", "size = \"1.5g\"")).expect("1.5g");
        assert_eq!(c.targets[0].luns[0].size, Some(Size(3 << 29)));
        assert_eq!(parse_size("1GB"), Ok(1_000_000_000));
        // Busy polling: off unless given, below a second down to microseconds, at most 1 s,
        // taken at the next start.
        assert!(parse(GOOD).expect("good").server.busy_poll.is_zero());
        let c = parse(&with("busy_poll = \"200us\"")).expect("200us");
        assert_eq!(c.server.busy_poll, Duration::from_micros(200));
        let e = refused(&with("busy_poll = \"2s\""));
        assert!(
            e.contains("server.busy_poll") && e.contains("at most 1s"),
            "{e}"
        );
        let off = parse(GOOD).expect("good").server;
        assert!(off
            .restart_only_differences(&c.server)
            .iter()
            .any(|(key, ..)| *key == "busy_poll"));
    }

    #[test]
    fn srp_port_settings_default_to_linux_and_are_checked() {
        let c = parse(GOOD).expect("good");
        assert_eq!(c.server.srp_max_iu_len, 8276, "ib_srp's default login fits");
        assert_eq!(c.server.srp_request_limit, 128);
        assert!(c.server.srp_immediate_data);
        let with = |line: &str| {
            GOOD.replace(
                "admin_socket = \"targetd.sock\"",
                &format!("admin_socket = \"targetd.sock\"\n{line}"),
            )
        };
        let c = parse(&with("srp_max_iu_len = 4096\nsrp_immediate_data = false")).expect("good");
        assert_eq!(
            (c.server.srp_max_iu_len, c.server.srp_immediate_data),
            (4096, false)
        );
        for (line, key) in [
            ("srp_max_iu_len = 9289", "server.srp_max_iu_len"),
            ("srp_max_iu_len = 64", "server.srp_max_iu_len"),
            ("srp_request_limit = 0", "server.srp_request_limit"),
            ("srp_request_limit = 4096", "server.srp_request_limit"),
        ] {
            let e = refused(&with(line));
            assert!(e.contains(key), "{line}: {e}");
        }
    }

    #[test]
    fn each_rdma_portal_may_have_its_own_srp_terms() {
        let with = |table: &str| {
            GOOD.replace(
                "admin_socket = \"targetd.sock\"",
                "admin_socket = \"targetd.sock\"\nrdma_portals = [\"10.0.0.1:5555\"]",
            )
            .replacen("[[targets]]", &format!("{table}\n\n[[targets]]"), 1)
        };
        let port = "[server.srp_ports.\"10.0.0.1:5555\"]";
        for (table, key, why) in [
            (
                "[server.srp_ports.\"10.0.0.9:5555\"]\nrequest_limit = 8".to_string(),
                "server.srp_ports.\"10.0.0.9:5555\"",
                "rdma_portals",
            ),
            (
                format!("{port}\nmax_iu_len = 10000"),
                "server.srp_ports.\"10.0.0.1:5555\".max_iu_len",
                "9288",
            ),
            (
                format!("{port}\nrequest_limit = 0"),
                "server.srp_ports.\"10.0.0.1:5555\".request_limit",
                "1 to 1024",
            ),
            (
                format!("{port}\nimmediate = true"),
                "immediate",
                "unknown field",
            ),
        ] {
            let e = refused(&with(&table));
            assert!(e.contains(key) && e.contains(why), "{table}: {e}");
        }
        // A port's own terms over the server's; another port, or the software fabric (no
        // address), has the server's.
        let mut c = parse(GOOD).expect("good");
        c.server.srp_request_limit = 100;
        let terms = SrpPortTerms {
            max_iu_len: Some(4196),
            request_limit: None,
            immediate_data: Some(false),
        };
        c.server.srp_ports.insert("10.0.0.1:5555".into(), terms);
        let at = |a: &str| Some(a.parse::<SocketAddr>().unwrap());
        assert_eq!(
            c.server.srp_terms(at("10.0.0.1:5555")),
            SrpTerms {
                max_iu_len: 4196,
                request_limit: 100,
                immediate_data: false
            }
        );
        assert_eq!(
            c.server.srp_terms(at("10.0.0.2:5555")),
            SrpTerms {
                max_iu_len: 8276,
                request_limit: 100,
                immediate_data: true
            }
        );
        assert_eq!(
            c.server.srp_terms(None),
            SrpTerms {
                max_iu_len: 8276,
                request_limit: 100,
                immediate_data: true
            }
        );
        // The dump keeps them, and reads back the same.
        let text = toml::to_string(&c).expect("dump");
        assert!(
            text.contains("[server.srp_ports.\"10.0.0.1:5555\"]"),
            "{text}"
        );
    }

    #[test]
    fn path_policies_belong_to_units_a_cluster_shares() {
        let e = refused(&GOOD.replace("size = \"1GiB\"", "size = \"1GiB\"\nstandby = true"));
        assert!(
            e.contains("targets[0].luns[0].standby") && e.contains("only the rbd backend"),
            "{e}"
        );
        if !cfg!(feature = "rbd") {
            return;
        }
        let rbd = GOOD.replace(
            "backend = \"file\"\npath = \"data/disk1.img\"",
            "backend = \"rbd\"\npool = \"rbd\"\nimage = \"disk1\"\npreferred_gateway = \"b\"",
        );
        let e = refused(&rbd);
        assert!(
            e.contains("targets[0].luns[0].preferred_gateway") && e.contains("[cluster]"),
            "{e}"
        );
        let cluster =
            "\n[cluster]\nname = \"gws\"\ngateway = \"a\"\nport_group = 1\npool = \"rbd\"\n";
        let lun = parse(&format!("{rbd}{cluster}"))
            .expect("in a cluster")
            .targets[0]
            .luns[0]
            .clone();
        assert_eq!(lun.preferred_gateway.as_deref(), Some("b"));
        let e = refused(&format!("{rbd}{cluster}").replace("\"b\"", "\"b c\""));
        assert!(e.contains("preferred_gateway"), "{e}");
    }

    #[test]
    fn rdma_portals_are_refused_with_the_reason() {
        let text = GOOD.replace(
            "admin_socket = \"targetd.sock\"",
            "rdma_portals = [\"0.0.0.0:5555\"]",
        );
        if rdma_unavailable().is_none() {
            eprintln!("this build serves RDMA on this machine: the portal is accepted");
            parse(&text).expect("accepted");
            return;
        }
        let e = refused(&text);
        assert!(e.contains("server.rdma_portals"), "{e}");
        #[cfg(not(feature = "rdma"))]
        assert!(e.contains("--features rdma"), "{e}");
        #[cfg(feature = "rdma")]
        assert!(e.contains("RDMA device"), "{e}");
    }

    #[test]
    fn in_capsule_data_beyond_a_message_buffer_is_refused_with_nvme_rdma_portals() {
        let mut c = parse(&format!("{GOOD}\n[nvme]\nin_capsule_data_size = 16384\n"))
            .expect("over TCP alone it is taken");
        c.server.nvme_rdma_portals = vec!["192.0.2.10:4420".into()];
        let (key, reason) = c.validate_nvme().expect_err("refused over RDMA");
        assert_eq!(key, "nvme.in_capsule_data_size");
        assert!(reason.contains("server.nvme_rdma_portals"), "{reason}");
        c.nvme.in_capsule_data_size = 8192;
        c.validate_nvme().expect("8 KiB fits a message buffer");
        // Without RDMA the portal is refused with the reason, naming its key.
        if rdma_unavailable().is_some() {
            let text = GOOD.replace(
                "admin_socket = \"targetd.sock\"",
                "nvme_rdma_portals = [\"0.0.0.0:4420\"]",
            );
            assert!(refused(&text).contains("server.nvme_rdma_portals"));
        }
    }

    #[test]
    fn each_bad_value_names_its_key() {
        let cases = [
            (GOOD.replace("iqn.2026-11.io.example:disk1", "disk1"), "targets[0].name"),
            (GOOD.replace("127.0.0.1:3260", "localhost"), "server.portals[0]"),
            (GOOD.replace("\"1GiB\"", "\"1 parsec\""), "unknown size unit"),
            (GOOD.replace("\"1GiB\"", "1000"), "targets[0].luns[0].size"),
            (GOOD.replace("backend = \"file\"", "backend = \"tape\""), "targets[0].luns[0].backend"),
            (GOOD.replace("path = \"data/disk1.img\"", ""), "targets[0].luns[0].path"),
            (GOOD.replace("lun = 0", "lun = 0\nblock_size = 1024"), "targets[0].luns[0].block_size"),
            (GOOD.replace("lun = 0", "lun = 20000"), "targets[0].luns[0].lun"),
            (format!("{GOOD}\n[[targets.luns]]\nlun = 0\nbackend = \"null\"\nsize = 4096\n"), "defined twice"),
            (format!("{GOOD}\n[[targets.luns]]\nlun = 1\nbackend = \"file\"\npath = \"data/disk1.img\"\n"), "backs another LUN"),
            (format!("{GOOD}\n[[targets]]\nname = \"iqn.2026-11.io.example:disk1\"\n"), "targets[1].name"),
            (format!("{GOOD}\n[iscsi]\nfirst_burst_length = 2097152\n"), "iscsi.first_burst_length"),
            (format!("{GOOD}\n[iscsi]\nmax_recv_data_segment_length = 100\n"), "iscsi.max_recv_data_segment_length"),
            (format!("{GOOD}\n[iscsi]\nheader_digest = [\"MD5\"]\n"), "iscsi.header_digest"),
            (format!("{GOOD}\n[iscsi]\ncmdsn_window = 0\n"), "iscsi.cmdsn_window"),
            (GOOD.replace("[[targets.luns]]", "chap = { username = \"u\", secret = \"short\" }\n[[targets.luns]]"), "targets[0].chap.secret"),
            (GOOD.replace("[[targets.luns]]", "mutual_chap = { username = \"t\", secret = \"0123456789ab\" }\n[[targets.luns]]"), "needs chap"),
            (GOOD.replace("[[targets.luns]]", "chap = { username = \"u\", secret = \"0123456789ab\" }\nmutual_chap = { username = \"t\", secret = \"0123456789ab\" }\n[[targets.luns]]"), "must differ"),
            (GOOD.replace("[[targets]]", "[iscsi]\ndiscovery_chap = { username = \"\", secret = \"0123456789ab\" }\n\n[[targets]]"), "iscsi.discovery_chap.username"),
            (GOOD.replace("[[targets]]", "[iscsi]\ndiscovery_mutual_chap = { username = \"t\", secret = \"0123456789ab\" }\n\n[[targets]]"), "iscsi.discovery_mutual_chap: needs discovery_chap"),
            (GOOD.replace("[[targets.luns]]", "networks = [\"10.0.0.0/33\"]\n[[targets.luns]]"), "targets[0].networks[0]"),
            (GOOD.replace("[[targets.luns]]", "initiators = [\"bob\"]\n[[targets.luns]]"), "targets[0].initiators[0]"),
            (GOOD.replace("admin_socket = \"targetd.sock\"", "engine = \"aio\""), "server.engine"),
            (GOOD.replace("admin_socket = \"targetd.sock\"", "rdma_portals = [\"ib0\"]"), "server.rdma_portals[0]"),
            (GOOD.replace("admin_socket = \"targetd.sock\"", "login_timeout = 0"), "server.login_timeout"),
            (GOOD.replace("admin_socket = \"targetd.sock\"", "send_timeout = 0"), "server.send_timeout"),
            (GOOD.replace("admin_socket = \"targetd.sock\"", "data_out_timeout = 3601"), "server.data_out_timeout: 3601: must be 1 to 3600"),
            (GOOD.replace("admin_socket = \"targetd.sock\"", "max_connections = 0"), "server.max_connections"),
            (GOOD.replace("admin_socket = \"targetd.sock\"", "max_sessions = 70000"), "server.max_sessions"),
            (GOOD.replace("lun = 0", "lun = 0\nmax_transfer_length = \"64MiB\""), "targets[0].luns[0].max_transfer_length"),
            (GOOD.replace("lun = 0", "lun = 0\nmax_transfer_length = 1000"), "targets[0].luns[0].max_transfer_length"),
            (GOOD.replace("lun = 0", "lun = 0\noptimal_transfer_length = 0"), "targets[0].luns[0].optimal_transfer_length"),
            (GOOD.replace("lun = 0", "lun = 0\nmax_transfer_length = \"256KiB\"\noptimal_transfer_length = \"1MiB\""), "at most the maximum transfer length 262144"),
        ];
        for (text, want) in cases {
            let e = refused(&text);
            assert!(e.contains(want), "expected {want:?} in: {e}");
        }
    }

    /// Memory units that together outgrow the host's memory and swap are refused, naming the
    /// unit that crosses the line and how much the others hold.
    #[test]
    fn memory_units_must_fit_in_the_host() {
        let memory = |lun: u16, size: &str| {
            format!("[[targets.luns]]\nlun = {lun}\nbackend = \"memory\"\nsize = \"{size}\"\n")
        };
        let text = format!("{GOOD}{}", memory(1, "1024TiB"));
        let e = refused(&text);
        assert!(
            e.contains("targets[0].luns[1].size")
                && e.contains("1024 TiB")
                && e.contains("memory and swap"),
            "{e}"
        );
        let c = parse(&format!("{GOOD}{}{}", memory(1, "6GiB"), memory(2, "6GiB"))).unwrap();
        assert!(c.validate_memory_units(Some(16 << 30)).is_ok());
        let (key, reason) = c.validate_memory_units(Some(8 << 30)).unwrap_err();
        assert_eq!(key, "targets[0].luns[2].size");
        assert!(
            reason.contains("6 GiB beside 6 GiB of other memory LUNs") && reason.contains("8 GiB"),
            "{reason}"
        );
        assert!(
            c.validate_memory_units(None).is_ok(),
            "unknown: not checked"
        );
    }

    #[test]
    fn keys_are_described_by_target_and_lun() {
        let text =
            format!("{GOOD}[[targets.luns]]\nlun = 5\nbackend = \"memory\"\nsize = \"1MiB\"\n");
        let c = parse(&text).unwrap();
        assert_eq!(
            c.describe_key("targets[0].luns[1].size"),
            "iqn.2026-11.io.example:disk1 LUN 5: size"
        );
        assert_eq!(
            c.describe_key("targets[0].chap.secret"),
            "target iqn.2026-11.io.example:disk1: chap.secret"
        );
        assert_eq!(c.describe_key("server.portals[0]"), "server.portals[0]");
        assert_eq!(c.describe_key("targets[9].name"), "targets[9].name");
    }

    #[test]
    fn one_file_backs_one_lun_however_its_path_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display().to_string();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("disk.img"), vec![0u8; 4096]).unwrap();
        std::os::unix::fs::symlink(dir.path().join("disk.img"), dir.path().join("link.img"))
            .unwrap();
        let two = |a: &str, b: &str| {
            format!(
                "{GOOD}\n[[targets.luns]]\nlun = 1\nbackend = \"file\"\npath = \"{b}\"\nsize = \"1GiB\"\n"
            )
            .replace("data/disk1.img", a)
        };
        for (a, b) in [
            (format!("{d}/disk.img"), format!("{d}/sub/../disk.img")),
            (format!("{d}/disk.img"), format!("{d}/./disk.img")),
            (format!("{d}/disk.img"), format!("{d}/link.img")),
            // Files that do not exist yet, named two ways.
            (format!("{d}/new.img"), format!("{d}/sub/../new.img")),
        ] {
            let e = refused(&two(&a, &b));
            assert!(
                e.contains("targets[0].luns[1].path") && e.contains("backs another LUN"),
                "{a} and {b}: {e}"
            );
        }
        parse(&two(&format!("{d}/disk.img"), &format!("{d}/other.img"))).expect("two files");
    }

    #[test]
    fn relative_paths_are_the_config_files_not_the_daemons() {
        let dir = tempfile::tempdir().unwrap();
        let text = GOOD.replace(
            "admin_socket = \"targetd.sock\"",
            "state_dir = \"state\"\nadmin_socket = \"run/t.sock\"",
        );
        let path = dir.path().join("config.toml");
        std::fs::write(&path, &text).unwrap();
        let c = Config::load(&path).unwrap();
        assert_eq!(
            c.targets[0].luns[0].path.as_deref(),
            Some(dir.path().join("data/disk1.img").as_path())
        );
        assert_eq!(c.server.admin_socket, dir.path().join("run/t.sock"));
        assert_eq!(c.server.state_dir, Some(dir.path().join("state")));
        // Absolute paths stay as they are.
        let abs = GOOD.replace("data/disk1.img", "/srv/disk.img");
        std::fs::write(&path, &abs).unwrap();
        let c = Config::load(&path).unwrap();
        assert_eq!(
            c.targets[0].luns[0].path.as_deref(),
            Some(Path::new("/srv/disk.img"))
        );
    }

    #[test]
    fn chap_secrets_longer_than_16_bytes_are_allowed() {
        let text = GOOD.replace(
            "[[targets.luns]]",
            "chap = { username = \"u\", secret = \"a-secret-of-thirty-two-bytes-ok!\" }\n[[targets.luns]]",
        );
        let c = parse(&text).expect("RFC 7143 allows longer secrets");
        let w = c.warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert_eq!(w[0].0, "targets[0].chap.secret");
        assert!(parse(GOOD).unwrap().warnings().is_empty());
        let e = refused(&GOOD.replace(
            "[[targets.luns]]",
            "chap = { username = \"u\", secret = \"elevenbytes\" }\n[[targets.luns]]",
        ));
        assert!(
            e.contains("targets[0].chap.secret") && e.contains("at least 12"),
            "{e}"
        );
    }

    #[test]
    fn transfer_lengths_default_to_the_arena_and_max_burst_length() {
        let c = parse(GOOD).unwrap();
        // 32 MiB and 1 MiB in 512-byte blocks.
        assert_eq!(c.targets[0].luns[0].transfer_lengths(), (65536, 2048));
        let c = parse(&GOOD.replace(
            "lun = 0",
            "lun = 0\nblock_size = 4096\nmax_transfer_length = \"512KiB\"",
        ))
        .unwrap();
        // The optimal length never exceeds the maximum.
        assert_eq!(c.targets[0].luns[0].transfer_lengths(), (128, 128));
        let c = parse(&GOOD.replace("lun = 0", "lun = 0\noptimal_transfer_length = \"128KiB\""))
            .unwrap();
        assert_eq!(c.targets[0].luns[0].transfer_lengths(), (65536, 256));
    }

    #[test]
    fn sizes_and_networks() {
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("512 MiB"), Ok(512 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("10GB"), Ok(10_000_000_000));
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("99999999999TiB").is_err());
        let n = Network::parse("10.1.0.0/16").unwrap();
        assert!(n.contains("10.1.200.3".parse().unwrap()));
        assert!(n.contains("::ffff:10.1.0.9".parse().unwrap()));
        assert!(!n.contains("10.2.0.1".parse().unwrap()));
        assert!(Network::parse("0.0.0.0/0")
            .unwrap()
            .contains("192.0.2.1".parse().unwrap()));
        assert!(Network::parse("::1")
            .unwrap()
            .contains("::1".parse().unwrap()));
        assert!(Network::parse("fe80::/10")
            .unwrap()
            .contains("fe80::1".parse().unwrap()));
        assert!(Network::parse("nope/8").is_err());
    }
}
