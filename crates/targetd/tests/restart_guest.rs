//! `systemctl restart` that keeps sessions, under Linux's own iSCSI initiator and NVMe/TCP
//! host: targetd runs on the host under a stand-in for systemd's service manager
//! (tests/common/program.rs) with `server.restart_keeps_sessions`; a Linux guest under QEMU
//! (scripts/rdma-guest.sh) logs in through 10.0.2.2 (the host's 127.0.0.1 to it) with
//! open-iscsi's defaults and connects with `nvme connect` (its defaults), runs fio's verified
//! random writes on both disks at once, and twice asks the host to restart targetd as
//! `systemctl restart` does: SIGTERM (the session and the controller go into the manager's
//! store), then a new process started with the store passed. Checked: fio's writes all read
//! back on both, no I/O error, no connection error, session recovery, controller reset or
//! reconnect in the guest's kernel log, the same TSIH and CNTLID before and after each
//! restart, each new process serving what the store kept (no login, no Connect). The longest
//! write fio saw on each is printed beside each restart's time from SIGTERM to the new
//! process listening.
//!
//! Needs what scripts/rdma-guest.sh needs, open-iscsi, nvme-cli and fio; without them it says which is
//! missing and skips, and fails under `CI`.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Instant;

use common::program::{nvme_server, Manager, Program};
use common::{guest, TARGET};

const GUEST_SCRIPT: &str = r#"
# open-iscsi's defaults (NOP-Outs every 5 s, replacement_timeout 120 s), but no automatic login.
start_iscsid iqn.2026-12.io.example:linux-restart
/bin/iscsiadm -m node -o new -T @TARGET@ -p 10.0.2.2:@PORT@ > /dev/null || fail "linux: node"
/bin/iscsiadm -m node -T @TARGET@ -p 10.0.2.2:@PORT@ --login > /dev/null || fail "linux: login failed"
find_disk "linux"
# Linux's NVMe/TCP host with its defaults (keep alive 5 s, reconnect after 10 s).
nvme connect -t tcp -a 10.0.2.2 -s @NVME_PORT@ -n @NQN@ --hostnqn=@HOST@ > /dev/null || fail "nvme connect failed"
wait_ns 1
echo "nvme: connected, $ns"
cntlid() { cat /sys/class/nvme/nvme*/cntlid 2>/dev/null | head -n 1; }
cntlid_before=$(cntlid)
seen=$(dmesg | wc -l)
fio --name=restart --filename=$disk --rw=randwrite --bs=4k --iodepth=16 --ioengine=libaio \
  --direct=1 --size=48m --verify=crc32c --do_verify=1 --verify_fatal=1 --thread \
  --output=/tmp/fio.txt > /dev/null 2>&1 &
fio=$!
fio --name=restart-nvme --filename=$ns --rw=randwrite --bs=4k --iodepth=16 --ioengine=libaio \
  --direct=1 --size=48m --verify=crc32c --do_verify=1 --verify_fatal=1 --thread \
  --output=/tmp/fio-nvme.txt > /dev/null 2>&1 &
fio_nvme=$!
for round in 1 2; do
  sleep 2
  said=$(wget -qO- http://10.0.2.2:@RESTART@/) || fail "restart $round: the host did not restart targetd"
  echo "restart $round: $said"
done
wait $fio
status=$?
grep -q "err= 0" /tmp/fio.txt && [ "$status" = 0 ] || { cat /tmp/fio.txt; fail "fio failed across the restarts"; }
echo "fio: verified 48 MiB of random 4 KiB writes across two restarts"
grep -E "^ *(read|write): |^ *clat .*max=" /tmp/fio.txt | awk '{$1=$1; print "fio: " $0}'
wait $fio_nvme
status=$?
grep -q "err= 0" /tmp/fio-nvme.txt && [ "$status" = 0 ] || { cat /tmp/fio-nvme.txt; fail "fio on NVMe/TCP failed across the restarts"; }
echo "fio: verified 48 MiB of random 4 KiB writes on NVMe/TCP across two restarts"
grep -E "^ *(read|write): |^ *clat .*max=" /tmp/fio-nvme.txt | awk '{$1=$1; print "fio nvme: " $0}'
[ -n "$cntlid_before" ] && [ "$cntlid_before" = "$(cntlid)" ] && echo "nvme: the same controller after the restarts ($cntlid_before)"
new=$(dmesg | awk "NR > $seen")
echo "$new" | grep -iE "conn error|connection[0-9:]* error|recovery|I/O error|blk_update_request|timed out|offline|reconnect|reset|failed" \
  && fail "the kernel saw trouble across the restarts" \
  || echo "linux: no connection error, recovery or I/O error in the kernel log"
/bin/iscsiadm -m node -T @TARGET@ -p 10.0.2.2:@PORT@ --logout > /dev/null && echo "linux: logged out"
nvme disconnect -n @NQN@ > /dev/null && echo "nvme: disconnected"
"#;

/// The TSIH of the one session `p` serves, if it serves one.
fn tsih(p: &Program) -> Option<u64> {
    let sessions = p.sessions();
    match sessions.as_array()?.as_slice() {
        [one] => one["tsih"].as_u64(),
        _ => None,
    }
}

#[test]
fn open_iscsi_and_linux_nvme_tcp_with_fio_go_on_across_two_restarts_through_the_store() {
    let Some(exes) = guest::tools(
        &["iscsid", "iscsiadm", "nvme", "fio"],
        "open-iscsi, nvme-cli or fio is missing (Debian packages open-iscsi, nvme-cli, fio)",
    ) else {
        return;
    };
    let manager = Arc::new(Manager::new());
    const NQN: &str = "nqn.2026-12.io.example:restart";
    let server = format!("restart_keeps_sessions = true\n{}", nvme_server(NQN));
    let program = Program::start_with(&server, Some(&manager));
    let port = program.addr.port();
    let nvme_port = program.nvme.expect("an NVMe/TCP portal").port();
    let program = Arc::new(Mutex::new(program));
    // Each restart: the TSIH before, the one after, and the time from SIGTERM to the new
    // process listening.
    let rounds = Arc::new(Mutex::new(Vec::new()));
    let restart = |round: usize| -> Box<dyn FnOnce() + Send> {
        let (program, manager, rounds) = (program.clone(), manager.clone(), rounds.clone());
        Box::new(move || {
            let mut p = program.lock().unwrap();
            let before = tsih(&p);
            let began = Instant::now();
            let pid = p.child.id();
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
            let status = p.child.wait().unwrap();
            let stored = manager.names().len();
            p.start_again(Some(&manager));
            let took = began.elapsed();
            let after = tsih(&p);
            println!(
                "restart {round}: {status}, {stored} descriptors stored, the next targetd \
                 listened {took:?} after SIGTERM; TSIH {before:?} then {after:?}"
            );
            rounds.lock().unwrap().push((before, after, stored));
        })
    };
    let (control, _done) = guest::on_requests(vec![restart(1), restart(2)]);
    let script = GUEST_SCRIPT
        .replace("@TARGET@", TARGET)
        .replace("@PORT@", &port.to_string())
        .replace("@NVME_PORT@", &nvme_port.to_string())
        .replace("@NQN@", NQN)
        .replace(
            "@HOST@",
            "nqn.2014-08.org.nvmexpress:uuid:4c696e75-7800-4000-8000-72657374",
        )
        .replace("@RESTART@", &control.to_string());
    let started = Instant::now();
    let Some(console) = guest::run_checked(
        "restart-guest",
        &script,
        &exes,
        &[],
        &[
            "linux: logged in",
            "restart 1: done",
            "restart 2: done",
            "fio: verified 48 MiB of random 4 KiB writes across two restarts",
            "nvme: connected",
            "fio: verified 48 MiB of random 4 KiB writes on NVMe/TCP across two restarts",
            "nvme: the same controller after the restarts",
            "nvme: disconnected",
            "linux: no connection error, recovery or I/O error in the kernel log",
            "linux: logged out",
        ],
    ) else {
        return;
    };
    for line in console.lines().filter(|l| l.starts_with("fio")) {
        println!("{line}");
    }
    let rounds = rounds.lock().unwrap().clone();
    assert_eq!(rounds.len(), 2);
    for (before, after, stored) in &rounds {
        assert!(before.is_some() && before == after, "{rounds:?}");
        // The two portals, the iSCSI connection, the controller's queues (its admin queue and
        // an I/O queue per guest CPU) and the state.
        assert!(*stored >= 6, "{rounds:?}");
    }
    let log = program.lock().unwrap().log();
    assert_eq!(
        log.matches("serving the sessions the service manager kept")
            .count(),
        2,
        "{log}"
    );
    assert!(manager.names().is_empty());
    println!(
        "open-iscsi and nvme-tcp with fio across two restarts in {:.0} s",
        started.elapsed().as_secs_f64()
    );
}
