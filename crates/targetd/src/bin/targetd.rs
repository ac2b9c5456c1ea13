//! `targetd CONFIG`: serves the config's targets over iSCSI/TCP until SIGTERM or SIGINT
//! (drain, exit 0); SIGHUP reloads the config. `targetd --check CONFIG` only checks it.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use targetd::{Config, Server};
use tokio::signal::unix::{signal, SignalKind};
use tracing_subscriber::EnvFilter;

/// The iSCSI target daemon.
#[derive(Parser)]
#[command(name = "targetd", version, about)]
struct Args {
    /// The config file (TOML; see config.toml in the repository).
    #[arg(required_unless_present_any = ["man", "completions"])]
    config: Option<PathBuf>,
    /// Check the config and exit: 0 when it is good, 1 with the key and the reason of every
    /// problem when it is not. Beside the syntax and every value, it checks what the start
    /// needs of this host without opening a unit for I/O or binding a port: that each file
    /// LUN's file exists (or has a size and a directory to be created in) and that this user
    /// may read and write it, the state directory and the admin socket's directory. Run it as
    /// the user the service runs as. Portals and Ceph clusters are not tried.
    #[arg(long)]
    check: bool,
    /// Log lines as text (colours only when stderr is a terminal) or as JSON objects, one a
    /// line, for log collectors.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Print targetd's man page (roff: `targetd --man > targetd.1`) and exit.
    #[arg(long, exclusive = true)]
    man: bool,
    /// Print a completion script for this shell (bash, zsh, fish, elvish, powershell) and exit.
    #[arg(long, exclusive = true, value_name = "SHELL")]
    completions: Option<clap_complete::Shell>,
    /// Take over from the running targetd that started this one (`targetctl upgrade`): its
    /// listening sockets and sessions come over the UNIX socket at PATH.
    #[arg(long, value_name = "PATH", hide = true, conflicts_with = "check")]
    take_over: Option<PathBuf>,
}

/// What a run (not `--man` or `--completions`) was asked.
struct Run {
    config: PathBuf,
    check: bool,
    log_format: LogFormat,
    take_over: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn main() -> ExitCode {
    // First, as it changes the environment: what a service manager passed (its file
    // descriptor store after a `systemctl restart`, targetd::fdstore).
    let passed = backend::passed::take_passed_fds();
    let mut args = Args::parse();
    if args.man {
        let cmd = <Args as clap::CommandFactory>::command();
        return match targetd::manual::print_man_page(cmd) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("targetd: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if let Some(shell) = args.completions {
        targetd::manual::print_completions(<Args as clap::CommandFactory>::command(), shell);
        return ExitCode::SUCCESS;
    }
    let Some(path) = args.config.take() else {
        return ExitCode::FAILURE;
    };
    let args = Run {
        config: path,
        check: args.check,
        log_format: args.log_format,
        take_over: args.take_over,
    };
    let config = match Config::load(&args.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("targetd: {e}");
            return ExitCode::FAILURE;
        }
    };
    if args.check {
        let file = args.config.display();
        let check = Server::check(&config);
        let warnings = config
            .warnings()
            .into_iter()
            .chain(check.warnings.into_iter().map(|w| (w.key, w.reason)));
        for (key, reason) in warnings {
            let key = config.describe_key(&key);
            println!("targetd: {file}: warning: {key}: {reason}");
        }
        if check.errors.is_empty() {
            println!("targetd: {file}: good");
            return ExitCode::SUCCESS;
        }
        for e in &check.errors {
            eprintln!(
                "targetd: {file}: {}: {}",
                config.describe_key(&e.key),
                e.reason
            );
        }
        return ExitCode::FAILURE;
    }
    let filter = std::env::var("RUST_LOG")
        .ok()
        .or_else(|| config.server.log.clone())
        .unwrap_or_else(|| "info".into());
    let filter = EnvFilter::try_new(&filter).unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match args.log_format {
        // Escape codes only for a person at a terminal, never into a journal or a file.
        LogFormat::Text => logs.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => logs.json().init(),
    }
    for (key, reason) in config.warnings() {
        tracing::warn!(key = %config.describe_key(&key), "{reason}");
    }
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("targetd: runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(async move {
        let targets: Vec<String> = config.targets.iter().map(|t| t.name.clone()).collect();
        let named = config.clone();
        let server = match &args.take_over {
            Some(link) => match targetd::takeover::take_over(link, config, args.config.clone()) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("targetd: taking over: {e}");
                    return ExitCode::FAILURE;
                }
            },
            None => {
                let passed = passed.unwrap_or_else(|e| {
                    tracing::error!("the descriptors the service manager passed: {e}");
                    Vec::new()
                });
                let mut restored = targetd::fdstore::Restored::take(passed);
                let listeners = std::mem::take(&mut restored.listeners);
                let entry = if restored.is_empty() {
                    targetd::server::ClusterEntry::Now
                } else {
                    targetd::server::ClusterEntry::KeepingSessions
                };
                // A start that fails leaves the store as it was, for the next attempt.
                let server = match Server::start_inheriting(
                    config,
                    args.config.clone(),
                    listeners,
                    entry,
                ) {
                    Ok(s) => s,
                    Err(e) => {
                        let key = named.describe_key(&e.key);
                        eprintln!("targetd: {}: {key}: {}", args.config.display(), e.reason);
                        return ExitCode::FAILURE;
                    }
                };
                if !restored.is_empty() {
                    let sessions = restored.serve(|h| server.adopt_sessions(h));
                    server.end_handover();
                    tracing::info!(sessions, "restart: serving the sessions the service manager kept");
                }
                server
            }
        };
        let registry = server.registry();
        // What `targetctl upgrade` starts unless told another binary: this one, as it was
        // (a package upgrade replaces the file under the same path), with the same log format.
        if let Ok(exe) = std::env::current_exe() {
            let log_format = match args.log_format {
                LogFormat::Text => "text",
                LogFormat::Json => "json",
            };
            let options = vec!["--log-format".to_string(), log_format.to_string()];
            registry.succession.set_executable(exe, options);
        }
        for p in server.portals() {
            println!("targetd: listening on {p}");
        }
        for t in &targets {
            println!("targetd: target {t}");
        }
        for p in server.nvme_portals() {
            println!("targetd: NVMe/TCP on {p}");
        }
        for s in registry.subsystems() {
            println!("targetd: subsystem {}", s.nqn);
        }
        println!(
            "targetd: engine {}; admin socket {}",
            registry.engine.lock().map(|e| e.clone()).unwrap_or_default(),
            registry.config().server.admin_socket.display()
        );
        let (Ok(mut term), Ok(mut int), Ok(mut hup)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
            signal(SignalKind::hangup()),
        ) else {
            eprintln!("targetd: cannot install signal handlers");
            return ExitCode::FAILURE;
        };
        if args.take_over.is_none() {
            // A successor is made the service's main process, ready, by its predecessor.
            targetd::notify::notify("READY=1");
        }
        let reload = registry.clone();
        let stop = async move {
            loop {
                tokio::select! {
                    _ = term.recv() => break,
                    _ = int.recv() => break,
                    _ = hup.recv() => {
                        targetd::notify::reloading();
                        // Never forced: what targetctl made and nobody saved stays.
                        let result = reload.reload(false);
                        targetd::notify::notify("READY=1");
                        // Who asked: whoever sent the signal; the kernel does not say here.
                        match result {
                            Ok(changes) if changes.is_empty() => tracing::info!(by = "SIGHUP", "reload: no change"),
                            Ok(changes) => for c in changes { tracing::info!(by = "SIGHUP", "reload: {c}") },
                            Err(e) => tracing::error!(by = "SIGHUP", "reload refused, the running config stays: {e}"),
                        }
                    }
                }
            }
            targetd::notify::notify("STOPPING=1");
        };
        server.run(stop).await;
        ExitCode::SUCCESS
    })
}
