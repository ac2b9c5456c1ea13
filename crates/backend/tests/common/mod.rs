//! What the tests share: which engines this machine can run.

use backend::{Engine, EngineChoice, EngineConfig};

/// The engines to test: io_uring when the kernel lets us set one up, and the thread pool.
/// Without io_uring the io_uring half is skipped with the reason, unless `CI` is set, where it
/// fails: CI machines must exercise both.
pub fn engines() -> Vec<EngineChoice> {
    let probe = Engine::new(EngineConfig {
        engine: EngineChoice::Uring,
        ..EngineConfig::default()
    });
    match probe {
        Ok(_) => vec![EngineChoice::Uring, EngineChoice::Threads],
        Err(e) if std::env::var_os("CI").is_some() => {
            panic!("io_uring cannot be set up ({e}) and CI requires it")
        }
        Err(e) => {
            eprintln!("skipping the io_uring engine: it cannot be set up here ({e})");
            vec![EngineChoice::Threads]
        }
    }
}
