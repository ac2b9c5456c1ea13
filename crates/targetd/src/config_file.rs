//! Writing the running config over the administrator's file without losing what they wrote:
//! comments, layout, the order of keys and tables, sizes written as `"1GiB"`, relative paths,
//! keys left at their defaults. Only what differs between the file and the running config
//! changes, in place.
//!
//! Three documents are compared: the file as written (`raw`), the file as targetd reads it
//! and would write it (`read`: parsed into a [`Config`] and serialized again, so defaults are
//! filled in and every value is in the serializer's form) and the running config serialized
//! (`running`). A value is kept as written where `read` and `running` agree, replaced (keeping
//! its comments) where they differ, added where the file lacks a key the running config needs
//! and removed where the running config has no such key. Targets are matched by name and LUNs
//! by number, not by position, so a removed target takes its own comments with it.

use std::path::Path;

use toml_edit::{ArrayOfTables, DocumentMut, Item, Table, Value};

use crate::config::Config;

/// Why a file could not be merged; the caller then writes the running config whole.
#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    /// The file on disk is not TOML (or not a config).
    #[error("the file is not a config targetd reads: {0}")]
    Unreadable(String),
    /// The running config did not serialize (cannot happen for a config that validated).
    #[error("the running config does not serialize: {0}")]
    Serialize(String),
}

/// `old` (the file's text, in `dir`) with the running config's values: see the module's docs.
pub fn merge(old: &str, dir: Option<&Path>, running: &Config) -> Result<String, MergeError> {
    let mut raw: DocumentMut = old
        .parse()
        .map_err(|e: toml_edit::TomlError| MergeError::Unreadable(e.to_string()))?;
    let mut typed: Config =
        toml::from_str(old).map_err(|e| MergeError::Unreadable(e.to_string()))?;
    if let Some(dir) = dir.filter(|d| !d.as_os_str().is_empty()) {
        typed.resolve_paths(dir);
    }
    let read = serialized(&typed)?;
    let running = serialized(running)?;
    let new = NewTables { dir };
    merge_table(
        raw.as_table_mut(),
        read.as_table(),
        running.as_table(),
        &new,
    );
    Ok(raw.to_string())
}

fn serialized(config: &Config) -> Result<DocumentMut, MergeError> {
    toml::to_string(config)
        .map_err(|e| MergeError::Serialize(e.to_string()))?
        .parse()
        .map_err(|e: toml_edit::TomlError| MergeError::Serialize(e.to_string()))
}

/// Makes `raw` hold `running`'s keys, keeping what `read` (raw as read) says is unchanged.
fn merge_table(raw: &mut Table, read: &Table, running: &Table, new_tables: &NewTables) {
    let gone: Vec<String> = raw
        .iter()
        .map(|(k, _)| k.to_string())
        .filter(|k| !running.contains_key(k))
        .collect();
    for k in gone {
        raw.remove(&k);
    }
    for (key, new) in running.iter() {
        let before = read.get(key);
        match raw.get_mut(key) {
            Some(item) => merge_item(item, before, new, new_tables),
            // Not in the file: added unless it is what reading the file gave anyway (a default).
            None if before.is_some_and(|b| same(b, new)) => {}
            None => {
                raw.insert(key, new.clone());
            }
        }
    }
}

fn merge_item(raw: &mut Item, read: Option<&Item>, running: &Item, new_tables: &NewTables) {
    if read.is_some_and(|r| same(r, running)) {
        return;
    }
    match (raw, running) {
        (Item::Table(raw), Item::Table(new)) => {
            let empty = Table::new();
            let read = read.and_then(Item::as_table).unwrap_or(&empty);
            merge_table(raw, read, new, new_tables);
        }
        (Item::Value(Value::InlineTable(raw)), Item::Table(new)) => {
            // Written inline (`chap = { ... }`): stays inline, its decor kept.
            let mut inline = new.clone().into_inline_table();
            inline.fmt();
            *inline.decor_mut() = raw.decor().clone();
            *raw = inline;
        }
        (Item::ArrayOfTables(raw), Item::ArrayOfTables(new)) => {
            let empty = ArrayOfTables::new();
            let read = read.and_then(Item::as_array_of_tables).unwrap_or(&empty);
            merge_array(raw, read, new, new_tables);
        }
        (Item::Value(raw), Item::Value(new)) => {
            let decor = raw.decor().clone();
            *raw = match (raw.as_str().map(units::parse_size), new.as_integer()) {
                // A size written with its unit ("1GiB") is written with one again.
                (Some(Ok(_)), Some(bytes)) => Value::from(size_text(bytes as u64)),
                _ => new.clone(),
            };
            *raw.decor_mut() = decor;
        }
        (raw, new) => *raw = new.clone(),
    }
}

/// `bytes` as the config's size keys read it: "2GiB" when a whole number of KiB, MiB, GiB
/// or TiB, else bytes ("1536B").
fn size_text(bytes: u64) -> String {
    let text = units::format_size(bytes);
    match units::parse_size(&text) {
        Ok(back) if back == bytes => text.replace(' ', ""),
        _ => format!("{bytes}B"),
    }
}

/// `[[targets]]`, `[[targets.luns]]`, `[[subsystems]]`, `[[subsystems.namespaces]]`: each
/// running table takes the file's table with the same identity (`name`, `lun`, `nqn`,
/// `nsid`), merged, or comes new; tables no longer running go with their
/// comments.
fn merge_array(
    raw: &mut ArrayOfTables,
    read: &ArrayOfTables,
    running: &ArrayOfTables,
    new_tables: &NewTables,
) {
    let mut merged = ArrayOfTables::new();
    let mut taken = vec![false; raw.len()];
    for new in running.iter() {
        let at = read.iter().enumerate().position(|(i, r)| {
            !taken[i] && identity(r) == identity(new) && identity(new).is_some()
        });
        match (
            at,
            at.and_then(|i| raw.get(i)),
            at.and_then(|i| read.get(i)),
        ) {
            (Some(i), Some(raw_table), Some(read_table)) => {
                taken[i] = true;
                let mut table = raw_table.clone();
                merge_table(&mut table, read_table, new, new_tables);
                merged.push(table);
            }
            _ => merged.push(new_tables.written(new)),
        }
    }
    *raw = merged;
}

/// How a target or LUN that is not in the file yet is written into it: as an administrator
/// would write it, not as the running config serializes it.
struct NewTables<'a> {
    /// The file's directory: paths under it are written relative to it, as the file reads
    /// them.
    dir: Option<&'a Path>,
}

/// A LUN's keys that are sizes, written with a unit.
const SIZE_KEYS: [&str; 3] = ["size", "max_transfer_length", "optimal_transfer_length"];
/// Its keys that are paths.
const PATH_KEYS: [&str; 3] = ["path", "ceph_conf", "keyring"];

impl NewTables<'_> {
    /// `table` (a `[[targets]]` or `[[targets.luns]]` entry) without the keys that say what
    /// leaving them out says (the defaults), its sizes with units ("128MiB") and its paths
    /// under the file's directory relative to it; its LUNs likewise.
    fn written(&self, table: &Table) -> Table {
        let mut t = table.clone();
        for units in ["luns", "namespaces"] {
            if let Some(units) = t.get_mut(units).and_then(Item::as_array_of_tables_mut) {
                for unit in units.iter_mut() {
                    *unit = self.written(unit);
                }
            }
        }
        for key in SIZE_KEYS {
            if let Some(bytes) = t.get(key).and_then(Item::as_integer) {
                t.insert(key, toml_edit::value(size_text(bytes as u64)));
            }
        }
        for key in PATH_KEYS {
            let relative = t
                .get(key)
                .and_then(Item::as_str)
                .zip(self.dir)
                .and_then(|(p, dir)| Path::new(p).strip_prefix(dir).ok())
                .map(|p| p.display().to_string());
            if let Some(relative) = relative.filter(|r| !r.is_empty()) {
                t.insert(key, toml_edit::value(relative));
            }
        }
        if t.contains_key("lun") {
            drop_defaults::<crate::config::Lun>(&mut t);
        } else if t.contains_key("nsid") {
            drop_defaults::<crate::config::Namespace>(&mut t);
        } else if t.contains_key("nqn") {
            drop_defaults::<crate::config::Subsystem>(&mut t);
        } else {
            drop_defaults::<crate::config::Target>(&mut t);
        }
        t.decor_mut().clear();
        // Placed after the table before it in the array (or its parent): a position taken
        // from the running config's own text would sort it among the file's tables by
        // another document's numbering, and could put a LUN under the next target's header.
        t.set_position(None);
        t
    }
}

/// Removes each key of `table` whose absence reads as the same `T`: what a default says.
fn drop_defaults<T: serde::de::DeserializeOwned + PartialEq>(table: &mut Table) {
    let read = |t: &Table| {
        let mut doc = DocumentMut::new();
        for (k, v) in t.iter() {
            doc.insert(k, v.clone());
        }
        toml::from_str::<T>(&doc.to_string()).ok()
    };
    let Some(whole) = read(table) else { return };
    let keys: Vec<String> = table.iter().map(|(k, _)| k.to_string()).collect();
    for key in keys {
        let mut without = table.clone();
        without.remove(&key);
        if read(&without).as_ref() == Some(&whole) {
            *table = without;
        }
    }
}

/// What names a table of an array: a target's `name`, a LUN's `lun`, a subsystem's `nqn`, a
/// namespace's `nsid`.
fn identity(t: &Table) -> Option<String> {
    ["name", "lun", "nqn", "nsid"]
        .iter()
        .find_map(|k| t.get(k).and_then(Item::as_value))
        .map(|v| v.to_string().trim().to_ascii_lowercase())
}

/// Whether two items say the same, whatever their layout.
fn same(a: &Item, b: &Item) -> bool {
    canonical(a) == canonical(b)
}

fn canonical(item: &Item) -> String {
    let mut item = item.clone();
    strip(&mut item);
    let mut doc = DocumentMut::new();
    doc.insert("x", item);
    doc.to_string()
}

/// Drops comments and whitespace so that only content is compared.
fn strip(item: &mut Item) {
    match item {
        Item::Table(t) => {
            t.decor_mut().clear();
            t.set_implicit(false);
            for (mut k, v) in t.iter_mut() {
                k.leaf_decor_mut().clear();
                strip(v);
            }
        }
        Item::ArrayOfTables(a) => {
            for t in a.iter_mut() {
                let mut table = Item::Table(std::mem::take(t));
                strip(&mut table);
                if let Item::Table(table) = table {
                    *t = table;
                }
            }
        }
        Item::Value(v) => {
            let text = v.to_string();
            let mut fresh: Value = text.trim().parse().unwrap_or_else(|_| v.clone());
            fresh.decor_mut().clear();
            if let Value::InlineTable(t) = &mut fresh {
                t.fmt();
            }
            if let Value::Array(a) = &mut fresh {
                a.fmt();
            }
            *v = fresh;
        }
        Item::None => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subsystems_and_namespaces_merge_as_targets_and_luns_do() {
        let file = "[server]\nportals = [\"127.0.0.1:3260\"]\n\n\
                    # The fast disks. Keep this comment.\n[[subsystems]]\n\
                    nqn = \"nqn.2026-11.io.example:ssd\"\n\n\
                    [[subsystems.namespaces]]\nnsid = 1\nbackend = \"memory\"\n\
                    size = \"64MiB\"   # small\n";
        let mut c: Config = toml::from_str(file).unwrap();
        let mut ns = c.subsystems[0].namespaces[0].clone();
        ns.nsid = 2;
        ns.unit.size = Some(crate::config::Size(128 << 20));
        c.subsystems[0].namespaces.push(ns);
        let merged = merge(file, None, &c).unwrap();
        assert!(
            merged.contains("# The fast disks. Keep this comment."),
            "{merged}"
        );
        assert!(merged.contains("size = \"64MiB\"   # small"), "{merged}");
        assert!(
            merged.contains(
                "[[subsystems.namespaces]]\nnsid = 2\nbackend = \"memory\"\nsize = \"128MiB\"\n"
            ),
            "{merged}"
        );
        assert!(!merged.contains("lun ="), "{merged}");
        let back: Config = toml::from_str(&merged).unwrap();
        assert_eq!(back.subsystems, c.subsystems);
    }

    const FILE: &str = r#"# The lab's targets. Keep this comment.

[server]
# Where initiators connect.
portals = ["127.0.0.1:3260"]   # loopback only
admin_socket = "targetd.sock"

# The first disk.
[[targets]]
name = "iqn.2026-11.io.example:disk1"

[[targets.luns]]
lun = 0
backend = "file"
path = "data/disk1.img"   # relative to this file
size = "1GiB"

# The second disk, to be removed.
[[targets]]
name = "iqn.2026-11.io.example:disk2"

[[targets.luns]]
lun = 0
backend = "memory"
size = "64MiB"
"#;

    fn running(text: &str) -> Config {
        Config::parse(Path::new("/etc/targetd/config.toml"), text).unwrap()
    }

    #[test]
    fn an_unchanged_config_is_written_back_as_it_was() {
        let c = running(FILE);
        let out = merge(FILE, Some(Path::new("/etc/targetd")), &c).unwrap();
        assert_eq!(out, FILE);
    }

    #[test]
    fn the_repo_config_is_saved_unchanged_with_every_comment() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config.toml");
        let text = std::fs::read_to_string(&path).unwrap();
        let c = Config::parse(&path, &text).unwrap();
        assert_eq!(merge(&text, path.parent(), &c).unwrap(), text);
    }

    #[test]
    fn changes_land_in_place_and_comments_stay() {
        let mut c = running(FILE);
        c.targets[0].luns[0].size = Some(crate::config::Size(2 << 30));
        c.targets.remove(1);
        let mut lun1 = c.targets[0].luns[0].clone();
        lun1.lun = 1;
        lun1.backend = "null".into();
        lun1.path = None;
        c.targets[0].luns.push(lun1);
        c.server.portals.push("127.0.0.2:3260".into());
        let out = merge(FILE, Some(Path::new("/etc/targetd")), &c).unwrap();
        for kept in [
            "# The lab's targets. Keep this comment.",
            "# Where initiators connect.",
            "# loopback only",
            "# The first disk.",
            "path = \"data/disk1.img\"   # relative to this file",
        ] {
            assert!(out.contains(kept), "{kept:?} lost:\n{out}");
        }
        assert!(
            out.contains("size = \"2GiB\""),
            "written as it was, with a unit:\n{out}"
        );
        assert!(
            !out.contains("disk2") && !out.contains("to be removed"),
            "{out}"
        );
        assert!(out.contains("127.0.0.2:3260"), "{out}");
        let back = Config::parse(Path::new("/etc/targetd/config.toml"), &out).unwrap();
        assert_eq!(back, c, "the file reads back as the running config:\n{out}");
    }

    /// A LUN or target added live is written with the keys an administrator would write:
    /// no defaults, sizes with units, paths under the file's directory relative to it.
    #[test]
    fn a_new_lun_or_target_is_written_as_a_person_would() {
        let mut c = running(FILE);
        let mut lun1 = c.targets[0].luns[0].clone();
        lun1.lun = 1;
        lun1.path = Some("/etc/targetd/data/disk3.img".into());
        lun1.size = Some(crate::config::Size(128 << 20));
        c.targets[0].luns.push(lun1);
        let mut t = c.targets[1].clone();
        t.name = "iqn.2026-11.io.example:disk4".into();
        t.luns[0].max_transfer_length = Some(crate::config::Size(8 << 20));
        c.targets.push(t);
        let out = merge(FILE, Some(Path::new("/etc/targetd")), &c).unwrap();
        let lun1 = "[[targets.luns]]\nlun = 1\nbackend = \"file\"\npath = \"data/disk3.img\"\n\
                    size = \"128MiB\"\n";
        assert!(out.contains(lun1), "{out}");
        let disk4 = "[[targets]]\nname = \"iqn.2026-11.io.example:disk4\"\n\n[[targets.luns]]\n\
                     lun = 0\nbackend = \"memory\"\nsize = \"64MiB\"\nmax_transfer_length = \"8MiB\"\n";
        assert!(out.contains(disk4), "{out}");
        for default in ["block_size", "thin", "write_cache", "read_only", "direct"] {
            assert!(!out.contains(default), "{default} spelled out:\n{out}");
        }
        let back = Config::parse(Path::new("/etc/targetd/config.toml"), &out).unwrap();
        assert_eq!(back, c, "the file reads back as the running config:\n{out}");
    }

    #[test]
    fn an_inline_table_stays_inline_and_defaults_are_not_spelled_out() {
        let file = FILE.replace(
            "name = \"iqn.2026-11.io.example:disk1\"\n",
            "name = \"iqn.2026-11.io.example:disk1\"\nchap = { username = \"u\", secret = \"0123456789ab\" }\n",
        );
        let mut c = running(&file);
        c.targets[0].chap.as_mut().unwrap().secret = "ba9876543210".into();
        let out = merge(&file, Some(Path::new("/etc/targetd")), &c).unwrap();
        assert!(
            out.contains("chap = { username = \"u\", secret = \"ba9876543210\" }"),
            "{out}"
        );
        assert!(
            !out.contains("write_cache"),
            "a default is not added:\n{out}"
        );
    }

    #[test]
    fn a_file_that_is_not_toml_is_not_merged() {
        assert!(matches!(
            merge("[server", None, &running(FILE)),
            Err(MergeError::Unreadable(_))
        ));
    }
}
