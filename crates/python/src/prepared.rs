//! Prepared request lists from Python: transfers checked and routed once by
//! `NativeEngine.prepare`, then posted by index as often as wanted (`NativePreparedList.post`),
//! each post a `NativeBatch` like `NativeEngine.submit` returns.

use multirail::{Engine, PreparedEntry, PreparedListId, SegmentId};
use pyo3::prelude::*;

use crate::{parse_opcode, parse_transport, to_py, InvalidArgumentError, NativeBatch};

/// Checks the four columns of a prepared list and turns them into engine entries.
pub(crate) fn entries(
    sources: &[u64],
    segments: &[u64],
    targets: &[u64],
    lengths: &[u64],
) -> PyResult<Vec<PreparedEntry>> {
    if sources.len() != segments.len()
        || sources.len() != targets.len()
        || sources.len() != lengths.len()
    {
        return Err(InvalidArgumentError::new_err(format!(
            "invalid argument `entries`: sources, segments, targets and lengths have different lengths ({}, {}, {}, {})",
            sources.len(),
            segments.len(),
            targets.len(),
            lengths.len()
        )));
    }
    Ok(sources
        .iter()
        .zip(segments)
        .zip(targets)
        .zip(lengths)
        .map(
            |(((&source, &segment), &target_offset), &length)| PreparedEntry {
                source,
                target: SegmentId(segment),
                target_offset,
                length,
            },
        )
        .collect())
}

/// `Engine::prepare` with the GIL released; the list as a Python object.
pub(crate) fn prepare(
    py: Python<'_>,
    engine: &Engine,
    entries: Vec<PreparedEntry>,
    transport: Option<&str>,
) -> PyResult<NativePreparedList> {
    let transport = parse_transport(transport)?;
    let owned = engine.clone();
    let len = entries.len();
    let id = py
        .allow_threads(move || owned.prepare(&entries, transport))
        .map_err(to_py)?;
    Ok(NativePreparedList {
        engine: engine.clone(),
        id,
        len,
    })
}

/// A prepared request list; freed when the object goes away (batches posted from it run on).
#[pyclass(module = "multirail._native", frozen)]
pub(crate) struct NativePreparedList {
    engine: Engine,
    id: PreparedListId,
    len: usize,
}

impl Drop for NativePreparedList {
    fn drop(&mut self) {
        // Already freed by `free()` is fine: the engine just says it does not know the list.
        let _ = self.engine.free_prepared(self.id);
    }
}

#[pymethods]
impl NativePreparedList {
    /// Number of entries.
    fn __len__(&self) -> usize {
        self.len
    }

    /// Engine id of the list.
    #[getter]
    fn id(&self) -> u64 {
        self.id.0
    }

    /// Posts the entries at `indices` (all, in order, when None) as `opcode` ("read" or
    /// "write") at `priority` into a new batch, and returns it. With `notify`, the message is
    /// sent to every segment the posted entries target once all of them completed. Nothing
    /// is posted when anything is wrong (InvalidArgumentError for a bad opcode, priority or
    /// index, a freed list; SourceNotRegisteredError for memory unregistered since;
    /// PeerDisconnectedError for a peer that exited). The GIL is released meanwhile.
    #[pyo3(signature = (opcode, priority, indices=None, notify=None))]
    fn post(
        &self,
        py: Python<'_>,
        opcode: &str,
        priority: u8,
        indices: Option<Vec<usize>>,
        notify: Option<String>,
    ) -> PyResult<NativeBatch> {
        let op = parse_opcode(opcode)?;
        let priority = multirail::Priority::from_u8(priority).ok_or_else(|| {
            InvalidArgumentError::new_err(format!(
                "invalid argument `priority`: {priority} is not PRIO_HIGH (0), PRIO_MEDIUM (1) or PRIO_LOW (2)"
            ))
        })?;
        let n = match &indices {
            Some(i) if i.is_empty() => {
                return Err(InvalidArgumentError::new_err(
                    "invalid argument `indices`: must name at least one entry",
                ))
            }
            Some(i) => i.len(),
            None => self.len,
        };
        let engine = self.engine.clone();
        let list = self.id;
        let id = py
            .allow_threads(move || {
                let batch = engine.allocate_batch(n)?;
                let posted = match &notify {
                    Some(msg) => engine.submit_prepared_with_notification(
                        batch,
                        list,
                        op,
                        priority,
                        indices.as_deref(),
                        msg,
                    ),
                    None => engine.submit_prepared(batch, list, op, priority, indices.as_deref()),
                };
                if let Err(e) = posted {
                    let _ = engine.free_batch(batch);
                    return Err(e);
                }
                Ok(batch)
            })
            .map_err(to_py)?;
        Ok(NativeBatch {
            engine: self.engine.clone(),
            id,
            len: n,
        })
    }

    /// Frees the list now (otherwise when the object goes away). Raises InvalidArgumentError
    /// when it was freed already.
    fn free(&self) -> PyResult<()> {
        self.engine.free_prepared(self.id).map_err(to_py)
    }
}
