//! `examples/tcp_target.rs`, the embedding example, against libiscsi's tools: `iscsi-inq`
//! reads its INQUIRY data, `iscsi-ls` discovers it and lists its LUN (a discovery session and
//! a normal one open at once), and `iscsi-test-cu` writes and reads back data through it. The
//! tools come from Debian's libiscsi-bin; without them the test says so and skips, unless CI
//! is set.

#[path = "../examples/tcp_target.rs"]
#[allow(dead_code)]
mod example;

use std::net::TcpListener;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Whether `tool` runs here; when it does not, prints why and skips, or fails under CI.
fn have(tool: &str) -> bool {
    let found = Command::new(tool).arg("--help").output().is_ok();
    if !found {
        assert!(
            std::env::var_os("CI").is_none(),
            "{tool} is missing (CI is set: install libiscsi-bin)"
        );
        println!("skipped: {tool} is not installed (Debian: libiscsi-bin)");
    }
    found
}

/// Runs `tool` with `args`; its standard output, after checking it succeeded.
fn run(tool: &str, args: &[&str]) -> String {
    let out = Command::new(tool).args(args).output().expect("it runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{tool} {args:?}: {}\n{text}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[test]
fn libiscsi_talks_to_the_embedding_example() {
    if !["iscsi-inq", "iscsi-ls", "iscsi-test-cu"]
        .iter()
        .all(|t| have(t))
    {
        return;
    }
    let listener = TcpListener::bind("127.0.0.1:0").expect("a port");
    let portal = listener.local_addr().expect("bound").to_string();
    let stop = Arc::new(AtomicBool::new(false));
    let server = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || example::serve(listener, || stop.load(Ordering::Relaxed)))
    };
    let lun = format!("iscsi://{portal}/{}/0", example::TARGET);

    let inq = run("iscsi-inq", &[&lun]);
    assert!(
        inq.contains("Peripheral Device Type:DIRECT_ACCESS"),
        "{inq}"
    );
    assert!(
        inq.contains("Vendor:EXAMPLE") && inq.contains("Product:memory"),
        "{inq}"
    );
    let vpd = run("iscsi-inq", &["-e", "1", "-c", "128", &lun]);
    assert!(vpd.contains("Unit Serial Number:"), "{vpd}");

    let ls = run("iscsi-ls", &["-s", &format!("iscsi://{portal}")]);
    assert!(
        ls.contains(&format!("Target:{} Portal:{portal},1", example::TARGET)),
        "{ls}"
    );
    assert!(ls.contains("Lun:0") && ls.contains("DIRECT_ACCESS"), "{ls}");

    // Data through the example: writes then reads compared, of several sizes and flags,
    // and COMPARE AND WRITE, which reads, compares and writes in one command.
    for suite in [
        "SCSI.Write10",
        "SCSI.Read10",
        "SCSI.CompareAndWrite",
        "SCSI.WriteVerify10",
    ] {
        let out = run(
            "iscsi-test-cu",
            &["-d", &format!("--test={suite}"), &lun, &lun],
        );
        assert!(
            out.contains("Tests completed with return value: 0") && !out.contains("FAILED"),
            "{suite}: {out}"
        );
    }

    stop.store(true, Ordering::Relaxed);
    server
        .join()
        .expect("the server thread")
        .expect("it served");
}
