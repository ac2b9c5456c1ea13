//! The command line: what each subcommand takes, and the conversions of its arguments into
//! the library's workload, login and SRP options.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand, ValueEnum};
use initiator_bench::login::LoginOptions;
use initiator_bench::nvme::NvmeOptions;
use initiator_bench::proxy::parse_duration;
use initiator_bench::srp::{LinkModel, RdmaOptions};
use initiator_bench::workload::{parse_size, Rw, Split, Workload};
use iscsi_pdu::chap::ChapCredentials;
use iscsi_pdu::negotiation::DigestAlgorithm;
use srp::initiator::Registration;

#[derive(Parser)]
#[command(
    name = "initiator-bench",
    version,
    about = "iSCSI initiator and load generator"
)]
pub(crate) struct Cli {
    /// Runtime threads for the initiator's I/O.
    #[arg(long, global = true, default_value_t = 1)]
    pub(crate) threads: usize,
    #[command(subcommand)]
    pub(crate) command: Cmd,
}

#[derive(Subcommand)]
pub(crate) enum Cmd {
    /// Run one workload and report IOPS, throughput and latency.
    Run {
        /// iscsi://[user%secret@]host[:port]/IQN/LUN; several spread the sessions over them.
        /// With `--transport srp`: `fabric`, an in-process SRP target over the software fabric,
        /// or srp://ADDR:PORT/TARGET/LUN on an RDMA device (feature rdma), TARGET a targetd
        /// target's name or a target port identifier in 32 hex digits. With `--transport iser`:
        /// iser://ADDR[:PORT]/IQN/LUN on an RDMA device (feature rdma). With `--transport
        /// nvme-tcp`: nvme://HOST[:PORT]/SUBNQN/NSID (port 4420 when absent); with
        /// `--transport nvme-rdma` the same, ADDR the RDMA device's (feature rdma).
        #[arg(required = true)]
        urls: Vec<String>,
        /// The transport; when not given, the URLs' scheme says: nvme:// NVMe/TCP, iser://
        /// iSER, srp:// (or `fabric`) SRP, anything else iSCSI.
        #[arg(long, value_enum)]
        transport: Option<Transport>,
        #[command(flatten)]
        srp: SrpArgs,
        #[command(flatten)]
        workload: WorkloadArgs,
        #[command(flatten)]
        login: LoginArgs,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        /// Record every command's stages (iSCSI, NVMe/TCP) into this trace file, for `trace report`
        /// beside the target's.
        #[arg(long)]
        trace: Option<PathBuf>,
        /// Failed I/Os tolerated: one more stops the run, which then counts as failed (exit
        /// status 1). A --multipath run is not stopped, only judged.
        #[arg(long, default_value_t = 0)]
        max_errors: u64,
        /// The URLs are paths to one logical unit or namespace (gateways of one target or
        /// subsystem): a session (controller) per path, I/O on the path ALUA (ANA) calls
        /// optimized, a command that fails on its path sent again on another; the report
        /// counts failovers and the longest wait.
        #[arg(long)]
        multipath: bool,
    },
    /// Run one workload per value of a parameter; write a table and a plot.
    Sweep {
        /// iscsi://[user%secret@]host[:port]/IQN/LUN
        url: String,
        /// The parameter to vary.
        #[arg(long, value_enum)]
        param: Param,
        /// Comma-separated values (sizes like 4k for bs, durations like 16ms for delay).
        #[arg(long, value_delimiter = ',', required = true)]
        values: Vec<String>,
        /// Directory for sweep.md, sweep.csv, sweep.json, sweep.svg and sweep.png.
        #[arg(long, default_value = "sweep-out")]
        out: PathBuf,
        /// Link rate for delay sweeps (e.g. 1gbit); unlimited when absent.
        #[arg(long)]
        rate: Option<String>,
        #[command(flatten)]
        workload: WorkloadArgs,
        #[command(flatten)]
        login: LoginArgs,
    },
    /// Relay TCP with a one-way delay each way (and a rate limit), like Dummynet.
    Proxy {
        /// Address to listen on.
        #[arg(long)]
        listen: String,
        /// Address to relay to.
        #[arg(long)]
        to: String,
        /// One-way delay, each direction (e.g. 16ms).
        #[arg(long, default_value = "0")]
        delay: String,
        /// Link rate each direction (e.g. 1gbit).
        #[arg(long)]
        rate: Option<String>,
        /// Cut every connection after this many bytes from the initiator (e.g. 1MiB): a fault
        /// in the middle of Data-Out.
        #[arg(long)]
        cut_upstream: Option<String>,
        /// Cut every connection after this many bytes from the target: a fault in the middle
        /// of Data-In.
        #[arg(long)]
        cut_downstream: Option<String>,
    },
    /// Run a workload on two targets in alternation and report the ratios.
    Compare {
        /// First target URL (A).
        url_a: String,
        /// Second target URL (B).
        url_b: String,
        /// Rounds of A and B, the order swapped every round.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// The targets' processes (`pidof targetd`), for targets on this machine: their CPU
        /// per I/O is measured around every run. Once: one process serves A and B; twice:
        /// A's, then B's (two builds of a target compared with this client fixed).
        #[arg(long, num_args = 1, value_name = "PID")]
        target_pid: Vec<u32>,
        #[command(flatten)]
        workload: WorkloadArgs,
        #[command(flatten)]
        login: LoginArgs,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Paper 004 over SRP on the software fabric: 128 KiB READs and WRITEs cut into 1 to 32
    /// discrete regions, for each way of registering the initiator's memory; writes
    /// paper004.md, paper004.csv, paper004.svg and paper004.png.
    Paper004 {
        /// Directory for the table and the plot.
        #[arg(long, default_value = "paper004-out")]
        out: PathBuf,
        /// Commands measured per point (each READ and each WRITE).
        #[arg(long, default_value_t = 512)]
        ios: u64,
    },
    /// Puts sweeps side by side: one table and one plot of a metric from several sweep.csv
    /// files (say, the same experiment against tgtd and targetd), with an ideal line if asked.
    Combine {
        /// LABEL=PATH of each sweep.csv, in the order of the columns.
        #[arg(required = true)]
        sweeps: Vec<String>,
        /// The column of the CSVs to compare (iops, bytes_per_sec, p50_us, p99_us, ...).
        #[arg(long, default_value = "iops")]
        metric: String,
        /// An ideal line y = SLOPE * x (paper 000: 1/RTT transactions per second per stream).
        #[arg(long)]
        ideal: Option<f64>,
        /// Divide the metric by this (1e6: bytes_per_sec as MB/s).
        #[arg(long, default_value_t = 1.0)]
        divide: f64,
        /// The y axis's name (the metric's when absent).
        #[arg(long)]
        y_label: Option<String>,
        /// The x axis's name.
        #[arg(long, default_value = "value")]
        x_label: String,
        /// The plot's title.
        #[arg(long, default_value = "")]
        title: String,
        /// STEM: writes STEM.md, STEM.svg and STEM.png.
        #[arg(long)]
        out: PathBuf,
    },
    /// Command traces (`targetctl trace start/stop`): what they say.
    Trace {
        #[command(subcommand)]
        action: TraceCmd,
    },
    /// Print a completion script for this shell (e.g. `initiator-bench completions bash >
    /// /etc/bash_completion.d/initiator-bench`).
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Write the man pages into DIR: initiator-bench.1 and one page per subcommand
    /// (initiator-bench-run.1).
    Man {
        /// An existing directory.
        dir: PathBuf,
    },
    /// List the targets a portal offers (SendTargets=All), or the NVM subsystems an NVMe/TCP
    /// discovery controller names for this host (its discovery log page).
    Discover {
        /// iscsi://host[:port], or nvme://host[:port] (port 8009 when absent).
        url: String,
        #[command(flatten)]
        login: LoginArgs,
    },
    /// Ping a target with iSCSI NOP-Outs, one at a time, and report the round trips: 48
    /// bytes each way through the target's connection and session, the floor under any
    /// command's latency (a read at queue depth 1 is this plus the read).
    Ping {
        /// iscsi://[user%secret@]host[:port]/IQN/LUN
        url: String,
        /// Pings (after 100 not counted, to warm up).
        #[arg(long, default_value_t = 10_000)]
        count: usize,
        #[command(flatten)]
        login: LoginArgs,
    },
}

#[derive(Subcommand)]
pub(crate) enum TraceCmd {
    /// Per-stage latency percentiles, commands in flight per layer, a diagnosis of where
    /// concurrency stopped (report.md), and a Chrome/Perfetto timeline (trace.json).
    Report {
        /// The target's trace file (`targetctl trace stop` wrote it).
        target_trace: PathBuf,
        /// The initiator's (`initiator-bench run --trace` wrote it): merged on one timeline.
        initiator_trace: Option<PathBuf>,
        /// The window of timeline.png: START:LENGTH in milliseconds from the first record.
        /// Default: ten times the median command's time at the target, from the middle of
        /// the trace.
        #[arg(long)]
        window: Option<String>,
        /// Move the initiator's times by the clock offset its NOP round trips give (traces
        /// from two hosts); without it, by its file's offset (0: one host).
        #[arg(long)]
        estimate_offset: bool,
        /// Directory for report.md and trace.json.
        #[arg(long, default_value = "trace-report")]
        out: PathBuf,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Transport {
    /// iSCSI over TCP.
    Iscsi,
    /// SRP over RDMA verbs (the software fabric: url `fabric`; a device: srp://...).
    Srp,
    /// iSCSI Extensions for RDMA on an RDMA device (iser://...).
    Iser,
    /// NVMe over TCP (nvme://HOST[:PORT]/SUBNQN/NSID).
    NvmeTcp,
    /// NVMe over RDMA on an RDMA device (nvme://ADDR[:PORT]/SUBNQN/NSID).
    NvmeRdma,
}

impl Transport {
    /// The transport the first URL's scheme names (as `compare` tells iSCSI from NVMe/TCP):
    /// nvme:// NVMe/TCP (NVMe/RDMA only when asked for), iser:// iSER, srp:// or `fabric`
    /// SRP, anything else iSCSI.
    pub(crate) fn of_urls(urls: &[String]) -> Transport {
        urls.first()
            .map_or(Transport::Iscsi, |u| Transport::of_url(u))
    }

    /// The transport one URL's scheme names (see [`Transport::of_urls`]).
    pub(crate) fn of_url(url: &str) -> Transport {
        match url {
            u if u.starts_with("nvme://") => Transport::NvmeTcp,
            u if u.starts_with("iser://") => Transport::Iser,
            u if u.starts_with("srp://") || u == "fabric" => Transport::Srp,
            _ => Transport::Iscsi,
        }
    }
}

#[derive(Args, Clone)]
pub(crate) struct SrpArgs {
    /// SRP, iSER and NVMe/RDMA: how the initiator registers its buffers (per-command, cache,
    /// pool).
    #[arg(long, default_value = "pool")]
    pub(crate) registration: Registration,
    /// SRP: regions each command's buffer is cut into (1 = contiguous; more = an indirect
    /// descriptor table). iSER names one buffer: 1.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=512))]
    pub(crate) regions: u16,
    /// SRP: what the software fabric charges (paper004: the paper's link and registration
    /// costs on a virtual clock; free: nothing).
    #[arg(long, value_enum, default_value = "paper004")]
    pub(crate) link: LinkModel,
    /// SRP and iSER: send every write's data by RDMA READ, even when the target grants
    /// immediate data (by default a write that fits in the IU carries its data in the SRP_CMD;
    /// over iSER the first 8 KiB go in the SCSI Command, ImmediateData=Yes).
    #[arg(long)]
    pub(crate) no_immediate_data: bool,
}

impl SrpArgs {
    pub(crate) fn options(&self) -> RdmaOptions {
        RdmaOptions {
            registration: self.registration,
            regions: usize::from(self.regions),
            link: self.link,
            immediate_data: !self.no_immediate_data,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum Param {
    Qd,
    Bs,
    Sessions,
    Delay,
}

#[derive(Args, Clone)]
pub(crate) struct WorkloadArgs {
    /// I/O pattern.
    #[arg(long, value_enum, default_value = "randread")]
    pub(crate) rw: Rw,
    /// Block size of each I/O (e.g. 512, 4k, 1m).
    #[arg(long, default_value = "4k", value_parser = parse_size)]
    pub(crate) bs: u64,
    /// Commands outstanding per session.
    #[arg(long, default_value_t = 32)]
    pub(crate) qd: usize,
    /// Sessions, each its own login.
    #[arg(long, default_value_t = 1)]
    pub(crate) sessions: usize,
    /// Run time (e.g. 10s).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub(crate) time: Duration,
    /// Total I/Os instead of a run time.
    #[arg(long)]
    pub(crate) ios: Option<u64>,
    /// Percent reads in rw and randrw.
    #[arg(long, default_value_t = 50)]
    pub(crate) rwmix: u8,
    /// Start of the range (e.g. 1g).
    #[arg(long, default_value = "0", value_parser = parse_size)]
    pub(crate) offset: u64,
    /// Length of the range; the rest of the LU when absent.
    #[arg(long, value_parser = parse_size)]
    pub(crate) size: Option<u64>,
    /// Write a seeded pattern with the LBA in every block and check it on read.
    #[arg(long)]
    pub(crate) verify: bool,
    /// Seed for random offsets and the verify pattern.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// How each I/O goes out: `none` (one command), a size (commands of at most that many
    /// bytes, in flight together), or `linux` (as Linux sizes requests from the LU's Block
    /// Limits page: at most its OPTIMAL TRANSFER LENGTH per command).
    #[arg(long, default_value = "none")]
    pub(crate) split: Split,
}

impl WorkloadArgs {
    pub(crate) fn workload(&self) -> anyhow::Result<Workload> {
        // Every LU's blocks are 512 bytes or a multiple: a size that is not one cannot be an
        // I/O of whole blocks (1gb is 10^9 bytes), so it is refused here, not by the target.
        if self.bs == 0 || self.bs % 512 != 0 {
            anyhow::bail!(
                "--bs {}: not a whole number of 512-byte blocks (4k, 64KiB, 1MiB are)",
                self.bs
            );
        }
        Ok(Workload {
            rw: self.rw,
            bs: u32::try_from(self.bs).context("--bs is too large")?,
            qd: self.qd,
            sessions: self.sessions,
            time: self.time,
            ios: self.ios,
            rwmix: self.rwmix,
            offset: self.offset,
            size: self.size,
            verify: self.verify,
            seed: self.seed,
            split: self.split,
            trace: false,
            max_errors: None,
        })
    }
}

#[derive(Args, Clone)]
pub(crate) struct LoginArgs {
    /// InitiatorName.
    #[arg(long, default_value = "iqn.2026-11.io.storage-target:initiator-bench")]
    pub(crate) initiator_name: String,
    /// HeaderDigest proposal, in preference order (None, CRC32C).
    #[arg(long, value_delimiter = ',', default_value = "None")]
    pub(crate) header_digest: Vec<String>,
    /// DataDigest proposal.
    #[arg(long, value_delimiter = ',', default_value = "None")]
    pub(crate) data_digest: Vec<String>,
    /// ImmediateData proposal.
    #[arg(long, default_value = "yes")]
    pub(crate) immediate_data: YesNo,
    /// InitialR2T proposal.
    #[arg(long, default_value = "no")]
    pub(crate) initial_r2t: YesNo,
    /// FirstBurstLength proposal.
    #[arg(long, default_value = "256k", value_parser = parse_size)]
    pub(crate) first_burst_length: u64,
    /// MaxBurstLength proposal.
    #[arg(long, default_value = "16776192", value_parser = parse_size)]
    pub(crate) max_burst_length: u64,
    /// MaxRecvDataSegmentLength this initiator declares.
    #[arg(long, default_value = "256k", value_parser = parse_size)]
    pub(crate) max_recv_data_segment_length: u64,
    /// MaxOutstandingR2T proposal.
    #[arg(long, default_value_t = 16)]
    pub(crate) max_outstanding_r2t: u16,
    /// Connections per session (MC/S).
    #[arg(long, default_value_t = 1)]
    pub(crate) connections: u16,
    /// CHAP name the target must prove (mutual CHAP).
    #[arg(long, requires = "target_secret")]
    pub(crate) target_user: Option<String>,
    /// CHAP secret the target must prove.
    #[arg(long, requires = "target_user")]
    pub(crate) target_secret: Option<String>,
    /// Timeout for the login and for each command.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub(crate) timeout: Duration,
    /// NVMe/TCP: the host's NQN (digests are asked for when --header-digest or
    /// --data-digest name CRC32C).
    #[arg(
        long,
        default_value = "nqn.2014-08.org.nvmexpress:uuid:8e1b3c9a-0000-4000-8000-696e69746961"
    )]
    pub(crate) hostnqn: String,
    /// NVMe/TCP: disable SQ flow control on the I/O queues (as Linux's --disable-sqflow):
    /// a read that succeeds ends with its data, no response capsule.
    #[arg(long)]
    pub(crate) disable_sqflow: bool,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum YesNo {
    Yes,
    No,
}

impl LoginArgs {
    /// How an NVMe/TCP host connects, from the same flags.
    pub(crate) fn nvme_options(&self, qd: usize) -> anyhow::Result<NvmeOptions> {
        nvme::fabrics::check_nqn(&self.hostnqn)
            .map_err(|e| anyhow::anyhow!("--hostnqn {:?}: {e}", self.hostnqn))?;
        let crc = |names: &[String]| names.iter().any(|n| n.eq_ignore_ascii_case("crc32c"));
        Ok(NvmeOptions {
            hostnqn: self.hostnqn.clone(),
            digests: nvme::tcp::Digests {
                header: crc(&self.header_digest),
                data: crc(&self.data_digest),
            },
            queue_entries: u16::try_from(qd.saturating_add(1).max(32)).unwrap_or(u16::MAX),
            disable_sqflow: self.disable_sqflow,
            ..NvmeOptions::default()
        })
    }

    pub(crate) fn options(&self) -> anyhow::Result<LoginOptions> {
        let digests = |names: &[String], key: &str| -> anyhow::Result<Vec<DigestAlgorithm>> {
            names
                .iter()
                .map(|n| match n.to_ascii_lowercase().as_str() {
                    "none" => Ok(DigestAlgorithm::None),
                    "crc32c" => Ok(DigestAlgorithm::Crc32c),
                    other => bail!("--{key}: {other:?} is neither None nor CRC32C"),
                })
                .collect()
        };
        let mut o = LoginOptions {
            initiator_name: self.initiator_name.clone(),
            ..LoginOptions::default()
        };
        o.settings.header_digest = digests(&self.header_digest, "header-digest")?;
        o.settings.data_digest = digests(&self.data_digest, "data-digest")?;
        o.settings.max_recv_data_segment_length = u32::try_from(self.max_recv_data_segment_length)?;
        let op = &mut o.settings.operational;
        op.immediate_data = matches!(self.immediate_data, YesNo::Yes);
        op.initial_r2t = matches!(self.initial_r2t, YesNo::Yes);
        op.first_burst_length = u32::try_from(self.first_burst_length)?;
        op.max_burst_length = u32::try_from(self.max_burst_length)?;
        op.max_outstanding_r2t = self.max_outstanding_r2t;
        o.connections = self.connections.max(1);
        o.timeout = self.timeout;
        if let (Some(u), Some(s)) = (&self.target_user, &self.target_secret) {
            o.mutual_chap = Some(
                ChapCredentials::new(u.clone(), s.as_bytes().to_vec(), 1)
                    .map_err(|e| anyhow::anyhow!("{e}"))?,
            );
        }
        let mut check = o.settings.clone();
        check.declarations.initiator_name = Some(o.initiator_name.clone());
        check
            .validate()
            .map_err(|e| anyhow::anyhow!("login settings: {e}"))?;
        Ok(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_without_transport_takes_the_urls_scheme() {
        let of = |u: &str| Transport::of_urls(&[u.to_string()]);
        assert_eq!(
            of("nvme://127.0.0.1/nqn.2026-12.io.example:a/1"),
            Transport::NvmeTcp
        );
        assert_eq!(
            of("iser://10.0.0.1/iqn.2026-12.io.example:a/0"),
            Transport::Iser
        );
        assert_eq!(of("srp://10.0.0.1:5000/t/0"), Transport::Srp);
        assert_eq!(of("fabric"), Transport::Srp);
        assert_eq!(
            of("iscsi://127.0.0.1/iqn.2026-12.io.example:a/0"),
            Transport::Iscsi
        );
        assert_eq!(Transport::of_urls(&[]), Transport::Iscsi);
    }
}
