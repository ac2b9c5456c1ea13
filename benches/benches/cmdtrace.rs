//! The record path of command tracing: a trace point when tracing is off (what every command
//! pays always), and when on (a record into the thread's ring; the ring is emptied between
//! batches so it never fills).

use std::hint::black_box;

use cmdtrace::{Record, Stage};
use criterion::{criterion_group, criterion_main, Criterion};

fn record() -> Record {
    Record {
        at_ns: 1,
        session: Record::session_of([0x80, 0, 0, 0, 0, 1], 1),
        itt: 7,
        cmd_sn: 7,
        stage: Stage::Received,
        lane: 0,
        arg: 4096,
    }
}

fn trace_points(c: &mut Criterion) {
    let r = record();
    cmdtrace::disarm();
    c.bench_function("trace point, tracing off", |b| {
        b.iter(|| cmdtrace::record(black_box(r)))
    });
    c.bench_function("trace point, tracing on", |b| {
        b.iter_batched(
            || cmdtrace::arm(1 << 16),
            |()| {
                for _ in 0..1024 {
                    cmdtrace::record(black_box(r));
                }
            },
            criterion::BatchSize::PerIteration,
        )
    });
    cmdtrace::disarm();
    c.bench_function("clock: CLOCK_MONOTONIC ns", |b| {
        b.iter(|| black_box(cmdtrace::now_ns()))
    });
}

criterion_group!(benches, trace_points);
criterion_main!(benches);
