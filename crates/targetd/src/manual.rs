//! Man pages and shell completion scripts for targetd's programs, generated from their clap
//! definitions so that they cannot drift from what is parsed.

use std::io;
use std::path::{Path, PathBuf};

/// Writes `cmd`'s man pages into `dir`: `NAME.1` and, for a program with subcommands, one
/// page per subcommand (`targetctl-lun-add.1`), which the first page's SUBCOMMANDS section
/// names. Returns the pages of the program now in `dir`.
pub fn write_man_pages(cmd: clap::Command, dir: &Path) -> io::Result<Vec<PathBuf>> {
    if !dir.is_dir() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("{}: no such directory", dir.display()),
        ));
    }
    let name = cmd.get_name().to_string();
    clap_mangen::generate_to(cmd, dir)?;
    let mut pages: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let file = p.file_name().and_then(|f| f.to_str()).unwrap_or_default();
            file == format!("{name}.1")
                || (file.starts_with(&format!("{name}-")) && file.ends_with(".1"))
        })
        .collect();
    pages.sort();
    Ok(pages)
}

/// Prints `cmd`'s one man page (a program without subcommands) to stdout.
pub fn print_man_page(cmd: clap::Command) -> io::Result<()> {
    clap_mangen::Man::new(cmd).render(&mut io::stdout())
}

/// Prints `cmd`'s completion script for `shell` to stdout.
pub fn print_completions(mut cmd: clap::Command, shell: clap_complete::Shell) {
    let name = cmd.get_name().to_string();
    clap_complete::generate(shell, &mut cmd, name, &mut io::stdout());
}
