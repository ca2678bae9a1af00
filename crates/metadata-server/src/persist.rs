//! One file per key in the data directory, replaced atomically.
//!
//! A file is named after the SHA-256 of its key (hex), not the key itself:
//! keys may be up to `max_key_bytes` long, far past the 255-byte file-name
//! limit, and may hold any character. The key is therefore stored inside the
//! file, next to the value:
//!
//! ```text
//! magic "MRMETA1\n" | key length u32 LE | value length u64 LE | key | value | xxh3-64 of all before, u64 LE
//! ```
//!
//! The checksum catches files damaged outside the server; the rename makes
//! a crash leave either the old file or the new one, never half of one.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::xxh3_64;

use crate::store::Value;

const MAGIC: &[u8; 8] = b"MRMETA1\n";
const HEADER_LEN: usize = MAGIC.len() + 4 + 8;
const TRAILER_LEN: usize = 8;
/// Temporary files start with this; a crash can leave them behind, and the
/// next start removes them.
const TMP_PREFIX: &str = ".tmp-";

/// The data directory: where every stored key lives as one file.
#[derive(Debug)]
pub(crate) struct Persistence {
    dir: PathBuf,
    /// Makes temporary names unique when two writes of one key overlap
    /// (they cannot today, the store serializes them, but a name clash would
    /// corrupt a file silently, so it costs nothing to rule out).
    tmp_counter: AtomicU64,
}

/// Why the data directory cannot be used: what is wrong with it, and the
/// operating system's error.
#[derive(Debug)]
pub(crate) struct OpenError {
    pub(crate) problem: String,
    pub(crate) source: Option<io::Error>,
}

/// Why a file in the data directory was not loaded.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DecodeError {
    #[error("too short or wrong magic (not a multirail metadata file)")]
    NotOurs,
    #[error("lengths in the header do not match the file size")]
    BadLength,
    #[error("checksum mismatch")]
    BadChecksum,
    #[error("key is not valid UTF-8")]
    KeyNotUtf8,
}

impl Persistence {
    /// Opens (creating if needed) `dir`, checks a file can be written there,
    /// and returns every key/value pair stored in it. Files that cannot be
    /// read or decoded are skipped with a warning; only a directory that
    /// cannot be created, listed or written to is an error, which says
    /// which of these failed.
    pub(crate) fn open(dir: &Path) -> Result<(Persistence, BTreeMap<String, Value>), OpenError> {
        let fail = |problem: String| {
            move |source| OpenError {
                problem,
                source: Some(source),
            }
        };
        match fs::metadata(dir) {
            Ok(meta) if !meta.is_dir() => {
                return Err(OpenError {
                    problem: "exists and is not a directory".into(),
                    source: None,
                })
            }
            Ok(_) => {}
            Err(_) => {
                fs::create_dir_all(dir).map_err(|source| {
                    // "Not a directory" from the OS does not say which part.
                    let file = dir
                        .ancestors()
                        .skip(1)
                        .find(|p| fs::metadata(p).is_ok_and(|m| !m.is_dir()));
                    let problem = match file {
                        Some(file) => {
                            format!("cannot be created: {} is not a directory", file.display())
                        }
                        None => "cannot be created".into(),
                    };
                    OpenError {
                        problem,
                        source: Some(source),
                    }
                })?;
            }
        }
        let persistence = Persistence {
            dir: dir.to_path_buf(),
            tmp_counter: AtomicU64::new(0),
        };
        // Find a read-only or full directory now rather than at the first PUT.
        let probe = persistence.tmp_path("probe");
        File::create(&probe).map_err(fail("is not writable".into()))?;
        fs::remove_file(&probe).map_err(fail("is not writable".into()))?;
        let entries = persistence
            .load()
            .map_err(fail("cannot be listed".into()))?;
        Ok((persistence, entries))
    }

    fn load(&self) -> io::Result<BTreeMap<String, Value>> {
        let mut entries = BTreeMap::new();
        let mut skipped = 0usize;
        for entry in fs::read_dir(&self.dir)? {
            let entry = match entry {
                Ok(entry) => entry,
                Err(err) => {
                    tracing::warn!(dir = %self.dir.display(), %err, "cannot list an entry of the metadata data dir; skipped");
                    skipped += 1;
                    continue;
                }
            };
            let path = entry.path();
            let name = entry.file_name();
            let Some(name) = name.to_str() else {
                tracing::warn!(path = %path.display(), "file name is not UTF-8, not a metadata file; skipped");
                skipped += 1;
                continue;
            };
            if name.starts_with(TMP_PREFIX) {
                // A write that crashed before its rename: the old file (if
                // any) is still the committed value.
                if let Err(err) = fs::remove_file(&path) {
                    tracing::warn!(path = %path.display(), %err, "cannot remove a leftover temporary file");
                }
                continue;
            }
            match self.load_file(&path, name) {
                Ok((key, value)) => {
                    entries.insert(key, value);
                }
                Err(reason) => {
                    tracing::warn!(path = %path.display(), %reason, "metadata file skipped");
                    skipped += 1;
                }
            }
        }
        tracing::info!(
            dir = %self.dir.display(),
            keys = entries.len(),
            skipped,
            "metadata data dir loaded"
        );
        Ok(entries)
    }

    fn load_file(&self, path: &Path, name: &str) -> Result<(String, Value), String> {
        let meta = fs::symlink_metadata(path).map_err(|e| e.to_string())?;
        if !meta.is_file() {
            return Err("not a regular file".into());
        }
        let data = fs::read(path).map_err(|e| e.to_string())?;
        let (key, value) = decode(&data).map_err(|e| e.to_string())?;
        // A file under another key's name would never be replaced or removed
        // by that key's PUT/DELETE, and would come back at every start.
        if file_name(&key) != name {
            return Err(format!("file name does not match its key {key:?}"));
        }
        Ok((key, value))
    }

    /// Stores `value` under `key`: written to a temporary file, flushed to
    /// disk, renamed over the key's file, and the directory flushed so the
    /// rename itself survives a power loss. Returns the I/O error on failure,
    /// after which the key's previous file is untouched.
    pub(crate) fn write(&self, key: &str, value: &[u8]) -> io::Result<()> {
        let name = file_name(key);
        let tmp = self.tmp_path(&name);
        let result = (|| {
            let mut file = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
            file.write_all(&encode(key, value))?;
            file.sync_all()?;
            drop(file);
            fs::rename(&tmp, self.dir.join(&name))?;
            self.sync_dir()
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result
    }

    /// Removes `key`'s file (absent is fine) and flushes the directory.
    pub(crate) fn remove(&self, key: &str) -> io::Result<()> {
        match fs::remove_file(self.dir.join(file_name(key))) {
            Ok(()) => self.sync_dir(),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(err) => Err(err),
        }
    }

    fn sync_dir(&self) -> io::Result<()> {
        File::open(&self.dir)?.sync_all()
    }

    fn tmp_path(&self, name: &str) -> PathBuf {
        let n = self.tmp_counter.fetch_add(1, Ordering::Relaxed);
        self.dir
            .join(format!("{TMP_PREFIX}{name}-{}-{n}", std::process::id()))
    }
}

/// The file name for `key`: lowercase hex SHA-256 of its bytes.
pub(crate) fn file_name(key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    let mut name = String::with_capacity(digest.len() * 2);
    for byte in digest {
        name.push(char::from_digit(u32::from(byte >> 4), 16).unwrap_or('0'));
        name.push(char::from_digit(u32::from(byte & 0xf), 16).unwrap_or('0'));
    }
    name
}

pub(crate) fn encode(key: &str, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + key.len() + value.len() + TRAILER_LEN);
    out.extend_from_slice(MAGIC);
    // Keys are bounded by Limits::max_key_bytes, far below u32::MAX; the
    // saturation only guards a misuse, which decode then rejects.
    out.extend_from_slice(&u32::try_from(key.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(&(value.len() as u64).to_le_bytes());
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(value);
    let checksum = xxh3_64(&out);
    out.extend_from_slice(&checksum.to_le_bytes());
    out
}

pub(crate) fn decode(data: &[u8]) -> Result<(String, Value), DecodeError> {
    if data.len() < HEADER_LEN + TRAILER_LEN || &data[..MAGIC.len()] != MAGIC {
        return Err(DecodeError::NotOurs);
    }
    let mut key_len = [0u8; 4];
    key_len.copy_from_slice(&data[8..12]);
    let mut value_len = [0u8; 8];
    value_len.copy_from_slice(&data[12..20]);
    let key_len = u32::from_le_bytes(key_len) as u64;
    let value_len = u64::from_le_bytes(value_len);
    let expected = (HEADER_LEN as u64 + TRAILER_LEN as u64)
        .checked_add(key_len)
        .and_then(|n| n.checked_add(value_len));
    if expected != Some(data.len() as u64) {
        return Err(DecodeError::BadLength);
    }
    let body_end = data.len() - TRAILER_LEN;
    let mut stored = [0u8; 8];
    stored.copy_from_slice(&data[body_end..]);
    if xxh3_64(&data[..body_end]) != u64::from_le_bytes(stored) {
        return Err(DecodeError::BadChecksum);
    }
    // Lengths were checked against the file size above, so these fit.
    let key_end = HEADER_LEN + key_len as usize;
    let key = std::str::from_utf8(&data[HEADER_LEN..key_end])
        .map_err(|_| DecodeError::KeyNotUtf8)?
        .to_owned();
    let value: Value = Arc::from(&data[key_end..body_end]);
    Ok((key, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_decode_round_trip() {
        let data = encode("mooncake/ram/host:1", b"\x00\xffvalue");
        let (key, value) = decode(&data).expect("decodes");
        assert_eq!(key, "mooncake/ram/host:1");
        assert_eq!(&value[..], b"\x00\xffvalue");
    }

    #[test]
    fn decode_rejects_damage() {
        let data = encode("k", b"v");
        assert!(matches!(decode(&data[..5]), Err(DecodeError::NotOurs)));
        assert!(matches!(
            decode(&data[..data.len() - 1]),
            Err(DecodeError::BadLength)
        ));
        let mut flipped = data.clone();
        flipped[HEADER_LEN] ^= 1;
        assert!(matches!(decode(&flipped), Err(DecodeError::BadChecksum)));
        let mut huge = data;
        huge[12..20].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(decode(&huge), Err(DecodeError::BadLength)));
    }

    #[test]
    fn file_name_is_hex_sha256() {
        let name = file_name("");
        assert_eq!(
            name,
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
