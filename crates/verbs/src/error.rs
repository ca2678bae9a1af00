//! Errors: which verb failed and why, in words an operator can act on.

use std::fmt;

/// Everything that can go wrong in this crate.
///
/// Cloneable so that the outcome of loading the library once can be handed
/// to every caller of [`crate::Verbs::get`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerbsError {
    /// `dlopen` found no libibverbs under any of the names tried.
    #[error("{library} not found: install rdma-core/libibverbs1 ({detail})")]
    LibraryNotFound {
        /// The first name tried (the one a user should install).
        library: String,
        /// What the dynamic loader said for each name tried.
        detail: String,
    },
    /// The library was found but lacks an entry point we need.
    #[error("{library} lacks symbol {symbol}: rdma-core is too old or not libibverbs")]
    MissingSymbol {
        /// The library that was opened.
        library: String,
        /// The symbol that was not exported.
        symbol: &'static str,
    },
    /// A verb returned an error; `verb` names it and the step, e.g.
    /// `ibv_modify_qp(RTR)`.
    #[error("{verb} failed: {} (errno {errno})", errno_text(*.errno))]
    Verb {
        /// The verb, with the step in parentheses where one verb serves several.
        verb: String,
        /// The errno the verb reported.
        errno: i32,
    },
    /// No RDMA device of this name is present.
    #[error("no RDMA device named {name:?} (present: {present})")]
    NoSuchDevice {
        /// The name asked for.
        name: String,
        /// The names present, comma separated, or "none".
        present: String,
    },
    /// An argument is outside what verbs or this crate accept.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A batch has no room for another work request or scatter/gather entry.
    #[error("batch full: capacity {wrs} work requests, {sges} scatter/gather entries")]
    BatchFull {
        /// The batch's work-request capacity.
        wrs: usize,
        /// The batch's scatter/gather capacity.
        sges: usize,
    },
    /// A post verb refused a work request.
    #[error(transparent)]
    Post(#[from] PostError),
    /// A work completion carried an error status.
    #[error("work request {wr_id} completed with {status_str} (status {status}, vendor error {vendor_err:#x})")]
    Completion {
        /// The `wr_id` of the failed request.
        wr_id: u64,
        /// The `ibv_wc_status` value.
        status: u32,
        /// `ibv_wc_status_str(status)`.
        status_str: &'static str,
        /// The provider's vendor error code.
        vendor_err: u32,
    },
}

impl VerbsError {
    /// A failed verb with its errno.
    pub(crate) fn verb(verb: impl Into<String>, errno: i32) -> Self {
        Self::Verb {
            verb: verb.into(),
            errno,
        }
    }

    /// A failed verb that returned NULL and left its reason in `errno`.
    pub(crate) fn last_os(verb: impl Into<String>) -> Self {
        let errno = errno_now();
        Self::verb(verb, errno)
    }

    /// A verb that returns 0 or an errno value (some providers return it
    /// negated, so both signs are accepted).
    pub(crate) fn check(verb: &str, ret: i32) -> Result<(), Self> {
        if ret == 0 {
            Ok(())
        } else {
            Err(Self::verb(verb, ret.checked_abs().unwrap_or(libc::EIO)))
        }
    }

    /// The errno behind this error, when a verb or post reported one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Self::Verb { errno, .. } => Some(*errno),
            Self::Post(p) => Some(p.errno),
            _ => None,
        }
    }
}

/// A post verb (`ibv_post_send`, `ibv_post_recv`, `ibv_post_srq_recv`)
/// refused the work request at `index_of_bad_wr`: the requests before it
/// were posted and will complete, that one and those after it were not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PostError {
    /// Which verb failed.
    pub verb: &'static str,
    /// Index in the batch of the first request not posted.
    pub index_of_bad_wr: usize,
    /// The errno the provider returned (ENOMEM: the queue is full; EINVAL:
    /// a malformed request or a QP in the wrong state).
    pub errno: i32,
}

impl fmt::Display for PostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} failed at work request {}: {} (errno {})",
            self.verb,
            self.index_of_bad_wr,
            errno_text(self.errno),
            self.errno
        )
    }
}

impl std::error::Error for PostError {}

/// The calling thread's errno, or EIO when a verb failed without setting it.
pub(crate) fn errno_now() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .filter(|&e| e != 0)
        .unwrap_or(libc::EIO)
}

/// strerror(errno) without the "(os error N)" suffix std adds.
pub(crate) fn errno_text(errno: i32) -> String {
    let full = std::io::Error::from_raw_os_error(errno).to_string();
    match full.rfind(" (os error ") {
        Some(cut) => full[..cut].to_owned(),
        None => full,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verb_error_names_verb_and_errno() {
        let e = VerbsError::verb("ibv_modify_qp(RTR)", libc::ENETUNREACH);
        assert_eq!(
            e.to_string(),
            "ibv_modify_qp(RTR) failed: Network is unreachable (errno 101)"
        );
        assert_eq!(e.errno(), Some(101));
    }

    #[test]
    fn check_accepts_both_signs() {
        assert!(VerbsError::check("x", 0).is_ok());
        assert_eq!(VerbsError::check("x", -22).unwrap_err().errno(), Some(22));
        assert_eq!(VerbsError::check("x", 22).unwrap_err().errno(), Some(22));
        assert_eq!(
            VerbsError::check("x", i32::MIN).unwrap_err().errno(),
            Some(libc::EIO)
        );
    }

    #[test]
    fn post_error_says_where() {
        let e = PostError {
            verb: "ibv_post_send",
            index_of_bad_wr: 3,
            errno: libc::ENOMEM,
        };
        assert_eq!(
            e.to_string(),
            "ibv_post_send failed at work request 3: Cannot allocate memory (errno 12)"
        );
    }
}
