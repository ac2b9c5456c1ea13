//! Paper 004 on the software fabric: 128 KiB commands as 32 discrete 4 KiB regions or one
//! contiguous region, for each way the initiator registers its memory, with the fabric's costs
//! set from the paper's measurements. Prints a markdown table (docs/experiments.md).
//!
//! `cargo run --release -p srp --example paper004 [COMMANDS]`

use srp::testing::{paper004, Registration};

fn main() {
    let commands = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(512);
    println!("| registration | regions per 128 KiB command | READ MB/s | WRITE MB/s | us per command | initiator registrations per command | target registrations | share of pool, contiguous |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    let mut contiguous_pool = 0.0;
    for registration in [
        Registration::Pool,
        Registration::Cache,
        Registration::PerCommand,
    ] {
        for regions in [1, 32] {
            let r = paper004(registration, regions, commands);
            if registration == Registration::Pool && regions == 1 {
                contiguous_pool = r.read_mb_s + r.write_mb_s;
            }
            let share = (r.read_mb_s + r.write_mb_s) / contiguous_pool * 100.0;
            println!(
                "| {registration:?} | {regions} | {:.0} | {:.0} | {:.1} | {:.2} | {} | {share:.0}% |",
                r.read_mb_s,
                r.write_mb_s,
                r.per_command_us,
                r.initiator_registrations_per_command,
                r.target_registrations,
            );
        }
    }
}
